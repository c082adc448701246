"""The pieces of Qwen3.5 that pipetune swaps in so it trains on CPU (package doc)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torchtitan.models.common.attention import VarlenAttention
from torchtitan.models.common.rope import CosSinRoPE
from torchtitan.models.qwen3_5 import _qwen35_deltanet_config
from torchtitan.models.qwen3_5.model import GatedDeltaKernel, GatedDeltaNet, Qwen35Model
from torchtitan.models.qwen3_5.vision_encoder import Qwen35VisionEncoder

from pipetune.config.model import BackboneConfig, ConfigError
from torchtitan_patches.models.document_attention import DocumentAttention, VisionMaskAttention
from torchtitan_patches.models.qwen3_5.gated_delta_cpu import causal_conv1d, gated_delta_rule


class CpuGatedDeltaKernel(GatedDeltaKernel):
    """TorchTitan's kernel dispatch; off CUDA the torch gated delta rule (``gated_delta_cpu``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(GatedDeltaKernel.Config):
        pass

    def forward(self, xq_BLNK, xk_BLNK, xv_BLNV, g_BLN, beta_BLN, *, cu_seqlens=None, cu_seqlens_cpu=None):
        if xq_BLNK.device.type == "cuda":
            return super().forward(xq_BLNK, xk_BLNK, xv_BLNV, g_BLN, beta_BLN, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
        repeat = xv_BLNV.shape[2] // xq_BLNK.shape[2]  # grouped heads, expanded as the parent does
        if repeat > 1:
            xq_BLNK, xk_BLNK = xq_BLNK.repeat_interleave(repeat, dim=2), xk_BLNK.repeat_interleave(repeat, dim=2)
        # without offsets fla runs the folded (1, B * L) row as one stream; so does this
        bounds = cu_seqlens_cpu.tolist() if cu_seqlens_cpu is not None else (0, xq_BLNK.shape[1])
        return gated_delta_rule(xq_BLNK, xk_BLNK, xv_BLNV, g_BLN, beta_BLN, bounds=bounds)


class CpuGatedDeltaNet(GatedDeltaNet):
    """TorchTitan's Gated DeltaNet; off CUDA its per-document causal conv in torch."""

    @dataclass(kw_only=True, slots=True)
    class Config(GatedDeltaNet.Config):
        pass

    def _causal_conv(self, x_BLD, conv, cu_seqlens=None, cu_seqlens_cpu=None):
        if cu_seqlens is None or x_BLD.device.type == "cuda" or isinstance(x_BLD, DTensor):
            return super()._causal_conv(x_BLD, conv, cu_seqlens, cu_seqlens_cpu)
        return causal_conv1d(x_BLD, conv.weight, bounds=cu_seqlens_cpu.tolist())


class VisionBlockAttention(VisionMaskAttention):
    """``VisionMaskAttention`` under the argument names (``q_BLNH`` ...) by which TorchTitan's
    Qwen3.5 sharding config (``set_gqa_inner_attention_local_map``) addresses its ViT's inner attention."""

    @dataclass(kw_only=True, slots=True)
    class Config(VisionMaskAttention.Config):
        pass

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, **kwargs):
        return super().forward(q_BLNH, k_BLNH, v_BLNH, attention_masks=attention_masks, **kwargs)


def patch_mask(num_patch: torch.Tensor, max_num_patch: int) -> torch.Tensor:
    """``(N, P, P)`` booleans: query and key are both real patches of image ``n`` (the dense form
    of TorchTitan's ``get_vision_block_mask_mod``)."""
    valid = torch.arange(max_num_patch, device=num_patch.device)[None, :] < num_patch[:, None]
    return valid[:, :, None] & valid[:, None, :]


class DenseMaskQwen35VisionEncoder(Qwen35VisionEncoder):
    """``Qwen35VisionEncoder`` whose ``forward`` (restated: the mask is built inside it) gives its
    blocks a dense mask instead of a compiled ``BlockMask``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Qwen35VisionEncoder.Config):
        pass

    def forward(self, pixel_values: torch.Tensor, *, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = grid_thw.tolist()
        x = self.patch_embed(pixel_values)
        learned_pos, rope_cache = self.compute_position_embeddings(grids, pixel_values.shape[1])
        mask = patch_mask(grid_thw.prod(-1), pixel_values.shape[1])
        return self.merger(self.blocks(x + learned_pos, rope_cache, mask))

    def blocks(self, x: torch.Tensor, rope_cache: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x, rope_cache=rope_cache, rope_apply=CosSinRoPE.apply_rotary_emb, attention_mask=mask)
        return x


def _init_fields(cfg) -> dict:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}


def _cpu_delta_net(dn: GatedDeltaNet.Config) -> CpuGatedDeltaNet.Config:
    return CpuGatedDeltaNet.Config(**{**_init_fields(dn), "kernel": CpuGatedDeltaKernel.Config(**_init_fields(dn.kernel))})


def gated_delta_net(backbone: BackboneConfig, *, tp: int = 1) -> CpuGatedDeltaNet:
    """One of the backbone's linear-attention layers as the model builds it (TorchTitan's Qwen3.5
    layer builder, ``with_cpu_paths``' CPU path), initialised; with ``tp``, one rank's shard of its
    heads. What the profiler times for the ``linear_attention`` curve."""
    la = backbone.linear_attention
    if la is None:
        raise ConfigError("this backbone has no linear-attention layers (backbone.linear_attention)")
    cfg = _qwen35_deltanet_config(dim=backbone.dim, n_key_heads=la.n_key_heads // tp, n_value_heads=la.n_value_heads // tp,
                                  key_head_dim=la.key_head_dim, value_head_dim=la.value_head_dim, layer_id=0,
                                  conv_kernel_size=la.conv_kernel)
    layer = _cpu_delta_net(cfg).build()
    layer.init_states()
    return layer


def with_cpu_paths(model_config: Qwen35Model.Config) -> Qwen35Model.Config:
    """A copy of a dense ``Qwen35Model.Config`` built with ``attn_backend="varlen"`` whose layers
    and ViT train on CPU (see module doc); on a GPU the decoder runs TorchTitan's kernels."""
    cfg = copy.deepcopy(model_config)
    for i, layer in enumerate(cfg.layers):
        if layer.moe is not None:
            raise ConfigError(f"layer {i} is a MoE layer: pipetune maps the dense Qwen3.5 flavours only (debugmodel, 0.8B ... 27B)")
        if layer.attention is not None:
            inner = layer.attention.inner_attention
            if not isinstance(inner, VarlenAttention.Config):
                raise ConfigError(f"layer {i} uses {type(inner).__name__}; build the spec with attn_backend='varlen', then apply with_cpu_paths")
            layer.attention.inner_attention = DocumentAttention.Config(window_size=inner.window_size)
        else:
            layer.delta_net = _cpu_delta_net(layer.delta_net)
    enc = cfg.vision_encoder
    block = dataclasses.replace(enc.block, attn=dataclasses.replace(enc.block.attn, inner_attention=VisionBlockAttention.Config()))
    cfg.vision_encoder = DenseMaskQwen35VisionEncoder.Config(**{**_init_fields(enc), "block": block})
    return cfg
