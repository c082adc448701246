"""What TorchTitan 0.3.0 calls in torch that torch 2.13 lacks, supplied from torch 2.13's own parts.

Supported pair: torch 2.13.0 with TorchTitan 0.3.0 (TorchTitan 0.3.0 was written against torch
2.14). Two gaps are met on the training path:

* ``torch.distributed.set_timeout`` (TorchTitan shortens process-group timeouts after step 1):
  torch 2.13 has the same operation as ``distributed_c10d._set_pg_timeout``;
  ``add_missing_torch_apis`` adds the public name.
* ``PipelineSchedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``: TorchTitan's stock
  pipeline step hands the schedule micro-batches it split itself; torch 2.13's ``step`` takes
  only the whole batch and splits it. ``add_missing_torch_apis`` lets ``step`` of the single- and
  multi-stage schedules take the micro-batch form too, doing what 2.13's ``step`` does around
  the split (backward flag and per-step state of every stage, ``_step_microbatches``, merged
  outputs); calls of the whole-batch form are unchanged. ``PipeTuneTrainer`` needs neither
  form (its plans run through ``PlanExecutor``); TorchTitan's own trainer, the baseline of
  ``benchmarks/vs_torchtitan.py``, needs the second.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

_MICRO_BATCH_KEYS = ("arg_mbs", "kwarg_mbs", "target_mbs")


def _accepting_micro_batches(step):
    @functools.wraps(step)
    def patched(self, *args, **kwargs):
        if not any(k in kwargs for k in _MICRO_BATCH_KEYS):
            return step(self, *args, **kwargs)
        if args:
            raise TypeError("step(arg_mbs=..., kwarg_mbs=..., target_mbs=...) takes no whole-batch positional arguments")
        if self._has_backward and not torch.is_grad_enabled():
            raise RuntimeError("step() requires gradients to be enabled for backward computation; call eval() instead")
        stages = self._stages if isinstance(self, PipelineScheduleMulti) else [self._stage]
        for stage in stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        return_outputs = kwargs.get("return_outputs", True)
        self._step_microbatches(kwargs.get("arg_mbs"), kwargs.get("kwarg_mbs"), kwargs.get("target_mbs"), kwargs.get("losses"),
                                return_outputs, loss_kwargs=kwargs.get("loss_kwargs"))
        for stage in stages:
            if stage.is_last and return_outputs:
                return self._merge_outputs(stage.output_chunks)
        return None

    patched.accepts_micro_batches = True
    return patched


def add_missing_torch_apis() -> None:
    """Give torch 2.13 the calls TorchTitan 0.3.0 makes (see the module doc); idempotent."""
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: distributed_c10d._set_pg_timeout(timeout, group)
    for schedule in (PipelineScheduleSingle, PipelineScheduleMulti):
        if not getattr(schedule.step, "accepts_micro_batches", False):
            schedule.step = _accepting_micro_batches(schedule.step)
