"""What TorchTitan 0.3.0 calls in torch that torch 2.13 lacks, supplied from torch 2.13's own parts.

Supported pair: torch 2.13.0 with TorchTitan 0.3.0 (TorchTitan 0.3.0 was written against torch
2.14). Two gaps are met on the training path:

* ``torch.distributed.set_timeout`` (TorchTitan shortens process-group timeouts after step 1):
  torch 2.13 has the same operation as ``distributed_c10d._set_pg_timeout``;
  ``add_missing_torch_apis`` adds the public name.
* ``PipelineSchedule.step(arg_mbs=..., kwarg_mbs=...)``: not needed, because ``PipeTuneTrainer``
  runs its plans through ``PlanExecutor`` and never calls a torch schedule's ``step``.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import distributed_c10d


def add_missing_torch_apis() -> None:
    """Give torch 2.13 the public names TorchTitan 0.3.0 calls (see the module doc); idempotent."""
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: distributed_c10d._set_pg_timeout(timeout, group)
