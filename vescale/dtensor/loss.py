"""``vescale.dtensor.loss.loss_parallel`` (veScale legacy's import path): upstream's
``torch.distributed.tensor.parallel.loss_parallel``, under which ``F.cross_entropy`` on logits
sharded on the class dim computes without gathering them (a Replicate result)."""

from torch.distributed.tensor.parallel import loss_parallel

__all__ = ["loss_parallel"]
