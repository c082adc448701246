"""What TorchTitan 0.3.0 calls in torch that torch 2.13 lacks, supplied from torch 2.13's own parts.

Supported pair: torch 2.13.0 with TorchTitan 0.3.0 (TorchTitan 0.3.0 was written against torch
2.14). Two gaps are met on the training path:

* ``torch.distributed.set_timeout`` (TorchTitan shortens process-group timeouts after step 1):
  torch 2.13 has the same operation as ``distributed_c10d._set_pg_timeout``; ``fill_gaps`` adds
  the public name.
* ``PipelineSchedule.step(arg_mbs=..., kwarg_mbs=...)``: not needed, because ``PipeTuneTrainer``
  runs its plans through ``PlanExecutor`` and never calls a torch schedule's ``step``.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import distributed_c10d


def fill_gaps() -> None:
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: distributed_c10d._set_pg_timeout(timeout, group)
