"""Graph passes, one per module, each ``GraphModule -> GraphModule``."""

from vescale.passes.annotate import annotate
from vescale.passes.bucket import bucket
from vescale.passes.eliminate import eliminate
from vescale.passes.fingerprint import RankDivergenceError, check_rank_consistency, fingerprint
from vescale.passes.manager import PassContext, PassManager
from vescale.passes.options import PASSES_OFF, BackendOptions
from vescale.passes.schedule import schedule

__all__ = [
    "PASSES_OFF",
    "BackendOptions",
    "PassContext",
    "PassManager",
    "RankDivergenceError",
    "annotate",
    "bucket",
    "check_rank_consistency",
    "eliminate",
    "fingerprint",
    "schedule",
]
