"""Roofline latency tables for a model on published hardware figures: the no-profiling default.

Every value these tables hold is an estimate (``LatencyTable.estimate``), built as follows for a
tensor-parallel degree ``tp`` (all work split evenly over the ``tp`` GPUs of a stage):

* A GEMM of ``W`` FLOPs over ``n`` tokens takes ``W / (peak * eff) * (1 + n_half / n)``, with
  ``n_half = gemm_half_tokens * tp``. This is Hockney's ``(r_inf, n_1/2)`` form: per-token time
  falls with ``n`` and flattens once ``n`` is several times ``n_half``, the shape of PipeTune
  Fig. 10 (a LLaMA-7B layer at TP 4: normalised latency drops until a few thousand tokens, then is
  flat). ``n_half`` grows with ``tp`` because each GPU's GEMMs get narrower. The constants are our
  assumptions, stored in ``pipetune/presets/hardware/*.toml``.
* Attention of one document of length ``l``: its FLOPs (causal pair count) at
  ``attention_*_efficiency`` with the same ``(1 + l_half / l)`` penalty (FlashAttention's tiles
  are poorly filled by short documents).
* A linear-attention layer's recurrence (``linear_attention``, over the chunk-padded packed
  length ``c``): its FLOPs (``FlopsModel.linear_attention_per_token``, small ``chunk``-sized
  matmuls) at the attention efficiencies with the ``(1 + l_half / c)`` penalty, plus its kernel
  launches; its projections are the ``rest`` of the layer.
* Memory-bound work (norms, RoPE, SwiGLU, residuals, embedding gathers, softmax of the loss):
  bytes moved / HBM bandwidth.
* Fixed costs per call: kernel launches (``kernel_launch_s`` each) and, with ``tp > 1``, two
  all-reduces of the hidden states per layer and pass (``tp_latency_s + 2 (tp-1)/tp * bytes /
  tp_bytes_per_s``). These make small micro-batches pay, so smaller is not always faster.
* Pipeline messages: ``p2p_latency_s + bytes / p2p_bytes_per_s``; activation offload copies the same
  way over ``host_*``.
* Activation memory per token and layer (BF16, FlashAttention, no recomputation): the saved
  inputs of the layer's matmuls and elementwise ops, ``2 * (6 d + 2 d_kv + 3 f) / tp`` bytes.
"""

from __future__ import annotations

import numpy as np

from pipetune.config.hardware import HardwareSpec
from pipetune.config.model import ModelConfig
from pipetune.cost.latency_table import Curve, LatencyTable
from pipetune.packing.flops import BACKWARD_FACTOR, FlopsModel, attention_pairs

BYTES = 2  # BF16
KERNELS_PER_LAYER_FWD = 14
KERNELS_PER_VIT_LAYER_FWD = 12
KERNELS_PER_LINEAR_ATTENTION_FWD = 10  # three causal convolutions, gates, the chunked rule's kernels, gated norm
ELEMENTWISE_VECTORS_PER_TOKEN = 24  # d-sized reads + writes per token and layer, forward


def _grid(hi: int, points: int = 48) -> np.ndarray:
    return np.unique(np.geomspace(1, hi, points).round()).astype(np.float64)


def analytical_table(model: ModelConfig, hw: HardwareSpec, *, tp: int = 1, max_tokens: int = 262_144, max_images: int = 1024) -> LatencyTable:
    """A latency table computed from ``model``'s FLOPs and ``hw``'s figures (see module doc)."""
    model.check_tp(tp)
    f = FlopsModel(model)
    b = model.backbone
    launch = hw.kernel_launch_s
    n_half = hw.gemm_half_tokens * tp

    def gemm(flops, n):
        return flops / tp / (hw.peak_flops * hw.gemm_efficiency) * (1 + n_half / n)

    def all_reduces(count, nbytes):
        if tp == 1:
            return 0.0 * nbytes
        return count * (hw.tp_latency_s + 2 * (tp - 1) / tp * nbytes / hw.tp_bytes_per_s)

    tokens = _grid(max_tokens)
    hidden_bytes = tokens * b.dim * BYTES
    elementwise = ELEMENTWISE_VECTORS_PER_TOKEN * hidden_bytes / hw.hbm_bytes_per_s
    rest_fwd = gemm(f.linear_per_token * tokens, tokens) + elementwise + KERNELS_PER_LAYER_FWD * launch + all_reduces(2, hidden_bytes)
    rest_bwd = (
        BACKWARD_FACTOR * gemm(f.linear_per_token * tokens, tokens)
        + 2 * elementwise
        + 2 * KERNELS_PER_LAYER_FWD * launch
        + all_reduces(2, hidden_bytes)
    )

    seq = _grid(max_tokens)
    attn_flops = f.attention_per_pair * attention_pairs(seq) / tp
    penalty = 1 + hw.attention_half_len / seq
    attn_fwd = attn_flops / (hw.peak_flops * hw.attention_fwd_efficiency) * penalty
    attn_bwd = BACKWARD_FACTOR * attn_flops / (hw.peak_flops * hw.attention_bwd_efficiency) * penalty

    embed_fwd = hidden_bytes / hw.hbm_bytes_per_s + launch
    embed_bwd = 2 * hidden_bytes / hw.hbm_bytes_per_s + 2 * launch
    logits_bytes = tokens * b.vocab_size / tp * 4
    head_fwd = gemm(f.head_per_token * tokens, tokens) + 2 * logits_bytes / hw.hbm_bytes_per_s + 4 * launch
    head_bwd = BACKWARD_FACTOR * gemm(f.head_per_token * tokens, tokens) + 2 * logits_bytes / hw.hbm_bytes_per_s + 4 * launch

    curves = {
        "rest": Curve("packed_len", tokens, rest_fwd, rest_bwd),
        "attention": Curve("seq_len", seq, attn_fwd, attn_bwd),
        "embedding": Curve("packed_len", tokens, embed_fwd, embed_bwd),
        "head": Curve("packed_len", tokens, head_fwd, head_bwd),
    }
    memory = {
        "layer_bytes_per_token": BYTES * (6 * b.dim + 2 * b.kv_dim + 3 * b.ffn_dim) / tp,
        "embedding_bytes_per_token": 0.0,
        "head_bytes_per_token": (b.dim * BYTES + b.vocab_size * 4) / tp,
        "image_feature_bytes": 0.0,
        "projector_bytes_per_image": 0.0,
    }
    la = b.linear_attention
    if la is not None:
        chunked = np.unique(np.geomspace(la.chunk, max(max_tokens, la.chunk), 48).round()).astype(np.float64)
        lin_flops = f.linear_attention_per_token * chunked / tp
        lin_penalty = 1 + hw.attention_half_len / chunked
        lin_fwd = lin_flops / (hw.peak_flops * hw.attention_fwd_efficiency) * lin_penalty + KERNELS_PER_LINEAR_ATTENTION_FWD * launch
        lin_bwd = (BACKWARD_FACTOR * lin_flops / (hw.peak_flops * hw.attention_bwd_efficiency) * lin_penalty
                   + 2 * KERNELS_PER_LINEAR_ATTENTION_FWD * launch)
        curves["linear_attention"] = Curve("chunked_len", chunked, lin_fwd, lin_bwd)
    enc = model.encoder
    if enc is not None:
        images = _grid(max_images, 32)
        p = enc.patches_per_image
        n = images * p
        vit_layer = gemm(2 * enc.layer_params * n, n)
        vit_attn = 4 * enc.dim * p * p * images / tp / (hw.peak_flops * hw.attention_fwd_efficiency) * (1 + hw.attention_half_len / p)
        patch = gemm(2 * enc.channels * enc.patch_size**2 * enc.dim * n, n)
        vit_elem = ELEMENTWISE_VECTORS_PER_TOKEN * n * enc.dim * BYTES / hw.hbm_bytes_per_s
        enc_fwd = patch + enc.n_layers * (vit_layer + vit_attn + vit_elem + KERNELS_PER_VIT_LAYER_FWD * launch + all_reduces(2, n * enc.dim * BYTES))
        enc_bwd = BACKWARD_FACTOR * enc_fwd if not enc.frozen else np.zeros_like(enc_fwd)
        proj_flops = f.projector_forward_per_image() * images
        k = images * enc.tokens_per_image
        proj_fwd = gemm(proj_flops, k) + 3 * launch
        proj_bwd = BACKWARD_FACTOR * gemm(proj_flops, k) + 6 * launch
        curves["encoder"] = Curve("images", images, enc_fwd, enc_bwd)
        curves["projector"] = Curve("images", images, proj_fwd, proj_bwd)
        memory["image_feature_bytes"] = p * enc.dim * BYTES
        memory["projector_bytes_per_image"] = enc.tokens_per_image * (enc.merged_dim + 2 * b.dim) * BYTES / tp
    return LatencyTable(
        model=model,
        curves=curves,
        memory=memory,
        p2p={"latency_s": hw.p2p_latency_s, "bytes_per_s": hw.p2p_bytes_per_s},
        host={"latency_s": hw.host_latency_s, "bytes_per_s": hw.host_bytes_per_s},
        device=f"{hw.name} (analytical estimate)",
        dtype="bfloat16",
        tp=tp,
        estimate=True,
        notes=("estimate: roofline from published peaks and assumed efficiencies, not measured",),
    )
