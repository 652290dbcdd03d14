"""Graph passes, one per module, each ``GraphModule -> GraphModule``."""

from vescale.passes.annotate import annotate
from vescale.passes.manager import PassContext, PassManager

__all__ = ["PassContext", "PassManager", "annotate"]
