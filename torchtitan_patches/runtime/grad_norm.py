"""Gradient clipping by the whole model's gradient norm, under any mix of PP, TP and FSDP/HSDP.

TorchTitan 0.3.0's ``dist_utils.clip_grad_norm_`` takes the norm of each rank's local gradients
and sums it over the pipeline only. Under its ``spmd_types`` backend, tensor-parallel parameters
are plain local shards (no DTensor to reduce), so with TP every rank computes the norm of its own
shards plus every TP-replicated parameter: the ranks of one stage then report, and clip by,
different norms (measured on TP 2 x PP 2: 0.0336 and 0.0351 on the two TP ranks of a step whose
norm is one number). ``clip_grad_norm_`` here sums each rank's squared local norms over the
world, each weighted by ``1 / copies``, where ``copies`` is how many ranks hold that same shard:
the tensor-parallel ranks that hold the parameter whole (``TensorParallelGrads.copies``), times
the mesh sizes of a DTensor's ``Replicate`` dims (HSDP's replicate axis). Each shard of
the model is then counted once, which is the global norm whatever the parallelism.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["clip_grad_norm_"]


def _local(g: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A gradient's local tensor and how many data-parallel ranks hold that same shard."""
    if not isinstance(g, DTensor):
        return g, 1
    copies = 1
    for dim, placement in enumerate(g.placements):
        if isinstance(placement, Replicate):
            copies *= g.device_mesh.size(dim)
    return g.to_local(), copies


@torch.no_grad()
def clip_grad_norm_(copies: dict[nn.Parameter, int], max_norm: float, *, device: torch.device, group=None) -> torch.Tensor:
    """Scale the gradients of ``copies``' parameters (``TensorParallelGrads.copies``) so that their global
    2-norm is at most ``max_norm``; returns that norm (the same number on every rank, on
    ``device``, no host synchronisation). ``group`` spans every rank of the job (default: the
    world; the all-reduce goes through its backend for ``device``)."""
    shared: dict[int, list[torch.Tensor]] = {}  # local gradients by how many ranks hold each
    for p, tp in copies.items():
        if p.grad is not None:
            local, dp = _local(p.grad)
            shared.setdefault(tp * dp, []).append(local)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for n, grads in shared.items():
        total += torch.stack(torch._foreach_norm(grads)).double().pow(2).sum() / n
    dist.all_reduce(total, group=group)
    norm = total.sqrt().float()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for grads in shared.values():
        torch._foreach_mul_(grads, scale.to(grads[0].dtype))
    return norm
