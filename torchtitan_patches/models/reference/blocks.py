"""TorchTitan building-block configs for our model shapes: LLaMA decoder layers and ViT layers."""

from __future__ import annotations

from functools import partial

import torch.nn as nn
from torchtitan.models.common import ComplexRoPE, Linear
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.common.nn_modules import GELU, LayerNorm, RMSNorm
from torchtitan.models.common.vision_encoder import VisionAttention, VisionMLP, VisionTransformerBlock
from torchtitan.models.llama3.model import Llama3TransformerBlock

from pipetune.config.model import BackboneConfig, EncoderConfig
from torchtitan_patches.models.packed_attention import PackedAttention


_INIT = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}


_ONES = {"weight": nn.init.ones_, "bias": nn.init.zeros_}


def decoder_layer_config(
    b: BackboneConfig, *, max_seq_len: int, attention_backend: str = "auto", tp: int = 1
) -> Llama3TransformerBlock.Config:
    """One LLaMA-style layer: RMSNorm, GQA with RoPE over packed documents, SwiGLU FFN.

    ``tp > 1`` builds one tensor-parallel rank's shard (``1/tp`` of the heads and of the FFN),
    for profiling the per-rank compute; the collectives between ranks are not part of it.
    """
    if b.n_kv_heads % tp or b.ffn_dim % tp:
        raise ValueError(f"TP={tp} does not divide n_kv_heads={b.n_kv_heads} and ffn_dim={b.ffn_dim}")
    return Llama3TransformerBlock.Config(
        attention_norm=RMSNorm.Config(normalized_shape=b.dim, eps=b.norm_eps, param_init=_ONES),
        ffn_norm=RMSNorm.Config(normalized_shape=b.dim, eps=b.norm_eps, param_init=_ONES),
        attention=make_gqa_config(
            dim=b.dim,
            n_heads=b.n_heads // tp,
            n_kv_heads=b.n_kv_heads // tp,
            head_dim=b.head_dim if tp > 1 else None,
            wqkv_param_init=_INIT,
            wo_param_init=_INIT,
            inner_attention=PackedAttention.Config(causal=True, backend=attention_backend),
            fuse_qkv=False,
            rope=ComplexRoPE.Config(dim=b.head_dim, max_seq_len=max_seq_len, theta=b.rope_theta),
        ),
        feed_forward=make_ffn_config(dim=b.dim, hidden_dim=b.ffn_dim // tp, w1_param_init=_INIT, w2w3_param_init=_INIT),
    )


def _linear(i: int, o: int, bias: bool = True) -> Linear.Config:
    return Linear.Config(in_features=i, out_features=o, bias=bias, param_init=_INIT)


def vit_layer_config(e: EncoderConfig, tp: int = 1) -> VisionTransformerBlock.Config:
    """One SigLIP-style layer: LayerNorm, full attention over an image's patches, GELU MLP
    (``tp > 1``: one tensor-parallel rank's shard, as for ``decoder_layer_config``)."""
    if e.n_heads % tp or e.ffn_dim % tp:
        raise ValueError(f"TP={tp} does not divide the encoder's n_heads={e.n_heads} and ffn_dim={e.ffn_dim}")
    local = e.dim // tp
    return VisionTransformerBlock.Config(
        norm1=LayerNorm.Config(normalized_shape=e.dim, eps=e.norm_eps, param_init=_ONES),
        norm2=LayerNorm.Config(normalized_shape=e.dim, eps=e.norm_eps, param_init=_ONES),
        attn=VisionAttention.Config(
            dim=e.dim,
            num_heads=e.n_heads,
            wq=_linear(e.dim, local),
            wk=_linear(e.dim, local),
            wv=_linear(e.dim, local),
            proj=_linear(local, e.dim),
            inner_attention=PackedAttention.Config(causal=False, backend="sdpa"),
        ),
        mlp=VisionMLP.Config(
            fc1=_linear(e.dim, e.ffn_dim // tp), fc2=_linear(e.ffn_dim // tp, e.dim), act_fn=GELU.Config(approximate="tanh")
        ),
    )


def no_rope(q, k, cache):
    """SigLIP uses learned absolute position embeddings, so the ViT blocks get an identity RoPE."""
    return q, k
