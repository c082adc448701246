"""Gated DeltaNet's two Triton pieces in plain torch, so Qwen3.5's linear-attention layers train on CPU.

TorchTitan's ``GatedDeltaNet`` (``models/qwen3_5``) calls ``flash-linear-attention`` (``fla``) for
the gated delta rule (``chunk_gated_delta_rule``, with q/k L2-normalised in the kernel) and for the
per-document causal depthwise convolution (``causal_conv1d`` with ``cu_seqlens``). Both are Triton
kernels with no CPU backend; fla's own torch references (``fla.ops.gated_delta_rule.naive``) loop
over every token or every row of a chunk in Python, take no ``cu_seqlens`` and no L2 norm.

``gated_delta_rule`` is fla's chunked (WY) form in torch: the within-chunk triangular system is
solved by ``torch.linalg.solve_triangular`` (naive.py's row loop), all chunks of all documents are
computed at once, and only the state recursion steps chunk by chunk; a document starts its own
chunks and a zero state, so no state crosses documents. ``causal_conv1d`` is the depthwise causal
convolution as ``kernel_size`` shifted, masked multiply-adds, a tap never reaching back past its
document's start. Gradients are torch autograd's. Computation in fp32, as fla's kernels accumulate;
outputs in the input's dtype. Meant for CPU and tests: the chunk recursion is a Python loop.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


CHUNK = 64
"""Chunk length, fla's default for the gated delta rule."""


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x**2) + eps)`` over the last dimension, fla's in-kernel L2 norm."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def _bounds(bounds, total: int) -> np.ndarray:
    b = np.asarray(bounds, dtype=np.int64)
    if b.ndim != 1 or b.size < 2 or b[0] != 0 or b[-1] != total or np.any(np.diff(b) < 0):
        raise ValueError(f"document bounds {list(b)} do not tile the {total} tokens (cumulative lengths from 0 to {total})")
    return b


def _chunk_layout(bounds: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For documents laid end to end: ``gather`` (a token index per padded slot, ``total`` for a pad
    slot), the padded slot of every token (``place``), and which chunks start a document."""
    total = int(bounds[-1])
    gather, place, starts = [], [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if a == b:
            continue
        n = -(-(b - a) // chunk)
        starts += [True] + [False] * (n - 1)
        place.append(np.arange(b - a) + len(gather))
        gather += list(range(a, b)) + [total] * (n * chunk - (b - a))
    return np.asarray(gather), np.concatenate(place), np.asarray(starts)


def gated_delta_rule(q, k, v, g, beta, *, bounds, scale: float | None = None, chunk: int = CHUNK) -> torch.Tensor:
    """``(1, T, H, K)`` q/k, ``(1, T, H, V)`` v, ``(1, T, H)`` log-decay ``g`` and ``beta`` -> ``(1, T, H, V)``.

    Per document of ``bounds`` (host cumulative lengths over the T tokens), the gated delta rule
    ``S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - k_t^T exp(g_t) S_{t-1})^T``, ``o_t = scale q_t^T S_t``
    with q and k L2-normalised (``use_qk_l2norm_in_kernel=True``) and a zero initial state.
    """
    if q.shape[0] != 1:
        raise ValueError(f"gated_delta_rule takes documents laid end to end in one row (batch 1), got batch {q.shape[0]}")
    T, H, K = q.shape[1:]
    V = v.shape[-1]
    b = _bounds(bounds, T)
    if T == 0:
        return v.new_zeros(v.shape)
    scale = K**-0.5 if scale is None else scale
    gather, place, starts = _chunk_layout(b, chunk)
    n = len(starts)
    idx = torch.as_tensor(gather, device=q.device)

    def padded(x: torch.Tensor) -> torch.Tensor:  # (1, T, H, ...) -> (H, n, chunk, ...) in fp32, pad slots 0
        x = x[0].float()
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])[idx]
        return x.reshape(n, chunk, H, *x.shape[2:]).movedim(2, 0)

    qc, kc = padded(l2norm(q.float())) * scale, padded(l2norm(k.float()))
    vc, gc, bc = padded(v), padded(g).cumsum(-1), padded(beta)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    diff = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf"))
    decay = diff.exp()  # exp(G_i - G_j) for j <= i, else 0
    kb = kc * bc[..., None]
    eye = torch.eye(chunk, device=q.device)
    system = eye + (kb @ kc.transpose(-1, -2) * decay).tril(-1)
    wy = torch.linalg.solve_triangular(system, eye.expand_as(system), upper=False, unitriangular=True)
    u = wy @ (vc * bc[..., None])
    w = wy @ (kb * gc.exp()[..., None])
    intra = (qc @ kc.transpose(-1, -2)) * decay
    state = qc.new_zeros(H, K, V)
    outs = []
    for i in range(n):
        if starts[i]:
            state = qc.new_zeros(H, K, V)
        v_new = u[:, i] - w[:, i] @ state
        outs.append((qc[:, i] * gc[:, i].exp()[..., None]) @ state + intra[:, i] @ v_new)
        g_end = gc[:, i, -1:]
        state = state * g_end.exp()[..., None] + (kc[:, i] * (g_end - gc[:, i]).exp()[..., None]).transpose(-1, -2) @ v_new
    o = torch.stack(outs, 1).movedim(0, 2).reshape(n * chunk, H, V)
    return o[torch.as_tensor(place, device=q.device)][None].to(v.dtype)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, *, bounds) -> torch.Tensor:
    """``silu`` of the depthwise causal convolution of ``x`` ``(1, T, D)`` with ``weight``
    ``(D, 1, kernel)`` (``nn.Conv1d``'s layout), restarted at every document of ``bounds``: what
    fla's ``causal_conv1d(..., activation="silu", cu_seqlens=...)`` computes."""
    T, kernel = x.shape[1], weight.shape[-1]
    b = _bounds(bounds, T)
    offset = np.arange(T) - np.repeat(b[:-1], np.diff(b))
    offset = torch.as_tensor(offset, device=x.device)[None, :, None]
    out = x * weight[:, 0, kernel - 1]
    for j in range(1, kernel):  # tap j reads x[t - j], within t's document only
        out = out + F.pad(x, (0, 0, j, 0))[:, :T] * weight[:, 0, kernel - 1 - j] * (offset >= j)
    return F.silu(out)
