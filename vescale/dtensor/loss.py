"""``vescale.dtensor.loss.loss_parallel`` (veScale legacy's import path): upstream's
``torch.distributed.tensor.parallel.loss_parallel``, under which ``F.cross_entropy`` on logits
sharded on the class dim computes without gathering them (a Replicate result)."""

from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from vescale import _patches
from vescale._torch_compat import upstream_loss_module

__all__ = ["end_loss_parallel", "loss_parallel"]


def end_loss_parallel() -> None:
    """Exit of ``loss_parallel()``: upstream pops the handlers it installed on entry; the ones
    they replaced (vescale's ``_log_softmax`` / ``nll_loss`` handlers) come back."""
    table = DTensor._op_dispatcher._custom_op_handlers
    for op in upstream_loss_module.customized_loss_ops:
        _patches.reapply(table, op)
