"""Tensor parallelism beside pipetune's plans: the gradient reduction TorchTitan leaves to FSDP.

TorchTitan 0.3.0's ``spmd_types`` backend types every parameter per mesh axis. Over TP, a
parameter is a shard (``S(d)``), or held whole by every TP rank: ``I`` (invariant: every rank
computes the same gradient) or ``R`` (replicated: each rank's gradient is a partial sum over its
own part of the work, e.g. the norms under sequence parallelism, where each rank normalises its
slice of the sequence, and the vision projection). TorchTitan sums ``R`` gradients over TP inside
FSDP ("pending BWD AR handled by FSDP", ``decoder_sharding.norm_config``): its ``fully_shard``
runs on a storage mesh that includes TP. pipetune applies FSDP over the data-parallel axes only,
or not at all (``runtime.data_parallel``), so ``TensorParallelGrads.reduce`` all-reduces the ``R``
gradients over the TP group itself, once per run, in one collective. ``copies`` says how many TP
ranks hold each parameter, for the global gradient norm (``runtime.grad_norm``).
"""

from __future__ import annotations

import spmd_types as spmd
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torchtitan.distributed.parallel_dims import MeshAxisName

__all__ = ["TensorParallelGrads"]


def _tp_type(module: nn.Module, name: str):
    """The TP type of ``module``'s parameter ``name`` in its sharding config (None: not declared,
    so not distributed over TP: every rank holds it whole and computes its whole gradient)."""
    config = getattr(module, "_sharding_config", None)
    layout = config.state_shardings.get(name) if config is not None else None
    return layout.per_axis_spmd_types().get(MeshAxisName.TP) if layout is not None else None


class TensorParallelGrads:
    """The trainable parameters of ``parts`` over a TP group of ``tp`` ranks (``group``)."""

    def __init__(self, parts: list[nn.Module], tp: int, group=None):
        self.group = group
        self.copies: dict[nn.Parameter, int] = {}
        self.partial: list[nn.Parameter] = []
        for part in parts:
            for module in part.modules():
                for name, p in module.named_parameters(recurse=False):
                    if not p.requires_grad:
                        continue
                    kind = _tp_type(module, name) if tp > 1 else None
                    self.copies[p] = 1 if isinstance(kind, spmd.Shard) else tp
                    if kind == spmd.R:
                        self.partial.append(p)

    def reduce(self) -> None:
        """Sum the partial gradients of ``R`` parameters over the TP group (one all-reduce)."""
        grads = [g.to_local() if isinstance(g, DTensor) else g for g in (p.grad for p in self.partial) if g is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        torch._foreach_copy_(grads, [part.view_as(g) for part, g in zip(flat.split([g.numel() for g in grads]), grads)])
