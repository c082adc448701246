"""TorchTitan's Qwen3.5 (dense) under pipetune: a model that trains on CPU, its stage and encoder chunk.

The model is TorchTitan's ``qwen3_5`` (``Qwen35Model``: Gated DeltaNet linear-attention layers
beside gated full-attention layers with MRoPE, a ViT whose ``PatchMerger`` hands merged tokens to
the decoder). ``with_cpu_paths`` swaps in, config by config, subclasses that run where TorchTitan's
pieces do not:

* full attention: ``DocumentAttention`` (pipetune's varlen counterpart, per-document SDPA on CPU);
* ``CpuGatedDeltaNet`` / ``CpuGatedDeltaKernel``: on a CUDA tensor TorchTitan's own forward (fla's
  Triton kernels); otherwise the torch versions in ``model.gated_delta_cpu`` (same math, per document);
* ``DenseMaskQwen35VisionEncoder``: TorchTitan's encoder builds a FlexAttention ``BlockMask`` with
  a compiled ``create_block_mask`` inside ``forward`` (no CPU backward, compilation fails on CPU),
  so its ``forward`` is restated with a dense per-image mask for ``VisionMaskAttention`` (as
  ``VisionBlockAttention``, under the argument names TorchTitan's sharding config uses).

Parameters, initialisation and the state-dict adapter stay TorchTitan's. ``parallelize_for_pipetune``
is TorchTitan's ``parallelize_qwen3_5`` without FSDP: with data parallelism pipetune applies FSDP
(HSDP) itself, one unit per decoder block, the ViT with its merger, and the root
(``model_parts.for_pipetune``, ``runtime.data_parallel``). Tensor parallelism is the model's own
plan (sequence-parallel decoder, Gated DeltaNet and full attention sharded by heads, the ViT by its
linear layers), with one change: the ViT's output conversion moves to its merger
(``merger_converts_output``), which pipetune runs on its own.

``Qwen35Stage`` runs a model part on pipetune's packed micro-batch: the document metadata feeds
both the full-attention and the DeltaNet layers, and the 3D MRoPE positions (``mrope_positions``)
are built on the host from the documents and the image spans, on every stage (later stages get no
tokens). ``Qwen35EncoderChunk`` runs the ViT blocks on stage 0's images; the merger (the adapter
step) runs in stage 0's forward, so it trains while the ViT is frozen, as pipetune's projector does.

Limits: the co-located layout only (the separated layout is refused in ``titan.job_checks``),
dense flavours only. Data parallelism (FSDP) and tensor parallelism are tested beside 2 pipeline
stages, each on 4 gloo ranks and both on 8 (test_qwen3_5_scale_out: the unsplit model's
gradients), and HSDP (replicate 2 x shard 2) beside 2 stages on 8 (2 steps, the same gradients).
Images come at their own resolution (the loader's patch grids; ``block_order`` puts each image's
patches in the merger's order). On a GPU the ViT keeps its dense masks (no FlexAttention) and every
stage uploads its MRoPE positions each forward. Tried on one H100 (torch 2.11, Triton 3.6): fla
refuses the DeltaNet's gated backward there (Triton 3.4 to 3.7.1 computes it wrongly on Hopper, fla
issue 640; it asks for Triton >= 3.7.1 or tilelang), so Qwen3.5 trains on Hopper only with those;
``test_stages_on_a_gpu_give_the_cpu_float64_models_gradients`` checks the GPU path's gradients where
it runs. Planning prices the DeltaNet layers as linear attention (``model_spec``); the profiler
times ``gated_delta_net``, the model's own layer rebuilt from the planning shapes.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import einops
import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.full_dtensor import validate_config
from torchtitan.models.common.attention import VarlenAttention, VarlenMetadata
from torchtitan.models.common.rope import CosSinRoPE
from torchtitan.models.qwen3_5 import _qwen35_deltanet_config, model_registry, parallelize_qwen3_5, qwen3_5_configs
from torchtitan.models.qwen3_5.model import GatedDeltaKernel, GatedDeltaNet, Qwen35Model
from torchtitan.models.qwen3_5.vision_encoder import Qwen35VisionEncoder, _compute_2d_rope_cache, _compute_learned_pos_embeds
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.protocols.sharding import ShardingConfig

from pipetune.config.model import BackboneConfig, ConfigError
from torchtitan_patches.model.gated_delta_cpu import causal_conv1d, gated_delta_rule
from torchtitan_patches.data.micro_batch import ImageSpan
from torchtitan_patches.model.vlm import scatter_spans
from torchtitan_patches.titan.document_attention import DocumentAttention, VisionMaskAttention
from torchtitan_patches.titan.stages import per_grid


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


def merger_converts_output(encoder: Qwen35VisionEncoder) -> None:
    """Move the encoder's output conversion (TP ``I`` -> ``R``, whose backward sums the merged
    tokens' gradients over TP: under sequence parallelism each TP rank's decoder sends back only
    its own slice's) from the encoder to its merger: pipetune runs the merger on its own in stage
    0's forward (``Qwen35Stage``), never the encoder's ``forward``. Before ``parallelize``."""
    config = encoder._sharding_config
    if config is None or config.out_dst_shardings is None:
        return
    encoder.merger._sharding_config = ShardingConfig(out_src_shardings=config.out_src_shardings, out_dst_shardings=config.out_dst_shardings)
    encoder._sharding_config = dataclasses.replace(config, out_src_shardings=None, out_dst_shardings=None)


def parallelize_for_pipetune(model, *, parallel_dims, training, parallelism, compile_config, ac_config, dump_folder, skip_dp: bool = False):
    """TorchTitan's ``parallelize_qwen3_5``; with ``skip_dp`` (what ``PipeTuneTrainer`` asks for) its
    steps before FSDP, in its order: the model's sharding plan (its ViT's output conversion on the
    merger, ``merger_converts_output``), activation checkpointing, compile (TorchTitan's function
    has no way to skip FSDP, which it applies last)."""
    if not skip_dp:
        return parallelize_qwen3_5(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                                   compile_config=compile_config, ac_config=ac_config, dump_folder=dump_folder)
    if parallel_dims.cp_enabled:
        raise NotImplementedError("context parallelism is not supported for Qwen3.5 (TorchTitan refuses it too)")
    if model.vision_encoder is not None:
        merger_converts_output(model.vision_encoder)
    if parallelism.spmd_backend == "spmd_types":
        validate_config(parallel_dims, model)
        model.parallelize(parallel_dims)
    elif parallel_dims.tp_enabled or parallel_dims.ep_enabled:
        model.parallelize(parallel_dims)
    if ac_config is not None:
        policy = ac_config.build(dump_folder=dump_folder)
        policy.apply(model)
        if model.vision_encoder is not None:
            policy.apply(model.vision_encoder)
    if compile_config.enable and "model" in compile_config.components:
        for m in (model, model.vision_encoder):
            if m is not None:
                apply_compile(m, compile_config=compile_config, parallel_dims=parallel_dims)
    return model


def _small_vocab(attn_backend: str) -> Qwen35Model.Config:
    """TorchTitan's ``debugmodel`` (8 layers of width 256, 6 Gated DeltaNet + 2 full attention; a
    4-block ViT of width 256 with a 2 x 2 merger) with a vocabulary of 2048 instead of Qwen's
    248,320, whose embedding and head (127 M of its 136 M parameters) would dominate a CPU test."""
    cfg = qwen3_5_configs["debugmodel"](attn_backend=attn_backend)
    vocab = 2048
    return dataclasses.replace(cfg, vocab_size=vocab, tok_embeddings=dataclasses.replace(cfg.tok_embeddings, num_embeddings=vocab),
                               lm_head=dataclasses.replace(cfg.lm_head, out_features=vocab))


FLAVORS = {"debugmodel_small_vocab": _small_vocab}
"""pipetune's Qwen3.5 size variants, by flavour name (beside TorchTitan's own)."""


def qwen3_5_spec(flavor: str = "debugmodel") -> ModelSpec:
    """TorchTitan's Qwen3.5 ``ModelSpec`` of a dense flavour (TorchTitan's or one of ``FLAVORS``)
    with ``with_cpu_paths`` applied and ``parallelize_for_pipetune``; split by TorchTitan's
    ``pipeline_vlm`` (pipetune hands it the layout through ``module_fqns_per_model_part``)."""
    if flavor in FLAVORS:
        spec = dataclasses.replace(model_registry("debugmodel", attn_backend="varlen"), flavor=flavor, model=FLAVORS[flavor]("varlen"))
    else:
        spec = model_registry(flavor, attn_backend="varlen")
    return dataclasses.replace(spec, model=with_cpu_paths(spec.model), parallelize_fn=parallelize_for_pipetune)


def block_order(rows: torch.Tensor, grid: tuple[int, int], merge: int) -> torch.Tensor:
    """``(n * h * w, patch_dim)`` patch rows of ``n`` images of ``grid`` in raster order (the
    loader's) -> ``(n, h * w, patch_dim)`` in Qwen's block order (each ``merge x merge`` group
    contiguous), the layout of TorchTitan's ``vision_to_patches(patch_order="block")``, which the
    merger expects (not importable here: its module imports torchvision). A patch is channel-first
    ``(c, pt, ph, pw)`` in both."""
    h, w = grid
    return einops.rearrange(rows, "(b bh m bw n) d -> b (bh bw m n) d", bh=h // merge, m=merge, bw=w // merge, n=merge)


def mrope_positions(bounds, images: list[tuple[int, tuple[int, int]]]) -> np.ndarray:
    """``(T, 3)`` temporal/height/width positions of packed documents (``bounds``: cumulative
    lengths), Qwen-VL's rule per document as TorchTitan's ``MultiModalCollator`` builds it: text
    counts on from the largest position so far on all three axes; an image of ``(rows, columns)``
    merged tokens (``images``: where each image's tokens begin, and its merged grid) sits at the
    next position plus its (0, row, column). Every document starts again from 0."""
    T = int(bounds[-1])
    out = np.empty((T, 3), dtype=np.int64)
    images = iter(sorted(images))
    s, grid = next(images, (None, None))
    for a, b in zip(bounds[:-1], bounds[1:]):
        cursor, offset = a, 0
        while s is not None and s < b:
            rows, cols = grid
            r, c = np.divmod(np.arange(rows * cols), cols)
            out[cursor:s] = (offset + np.arange(s - cursor))[:, None]
            offset += s - cursor
            out[s:s + rows * cols] = offset + np.stack([np.zeros_like(r), r, c], 1)
            offset += max(rows, cols)
            cursor = s + rows * cols
            s, grid = next(images, (None, None))
        out[cursor:b] = (offset + np.arange(b - cursor))[:, None]
    return out


class Qwen35Stage(nn.Module):
    """A Qwen3.5 model part with the executor's stage interface (see module doc)."""

    def __init__(self, part: Qwen35Model, *, is_first: bool, is_last: bool):
        super().__init__()
        self.part = part
        self.is_first, self.is_last = is_first, is_last

    def forward(self, x, *, positions, masks: VarlenMetadata, image_features: torch.Tensor | None = None,
                image_spans: tuple[ImageSpan, ...] = ()):
        part, merge = self.part, self.part.spatial_merge_size
        images = [(span.start, (span.grid[0] // merge, span.grid[1] // merge)) for span in image_spans]
        mrope = torch.from_numpy(mrope_positions(masks.cu_seq_q_host, images))[None].to(positions.device, non_blocking=True)
        kwargs = {"attention_masks": {"quadratic_attention": masks, "deltanet": masks}, "positions": positions, "mrope_positions": mrope}
        if part.tok_embeddings is None:
            return part(x, **kwargs)

        def embed(tokens, **_):  # the model's own hook for this call: the merger on the ViT's output, scattered at the host's spans
            x = part.tok_embeddings(tokens)
            if image_features is None:
                return x
            return scatter_spans(x, part.vision_encoder.merger(image_features[None])[0], image_spans)

        part._prepare_multimodal_embeds = embed
        try:
            return part(x, **kwargs)
        finally:
            del part._prepare_multimodal_embeds


class Qwen35EncoderChunk(nn.Module):
    """The whole ViT of a Qwen3.5 model part as the plan's one encoder chunk (co-located layout):
    the loader's patch rows and each image's grid in, the blocks' output in block order ``(patches,
    dim)`` out, before the merger (stage 0 runs it). Its parameters are the patch embedding,
    positions and blocks it runs (not the merger the encoder module also holds). Images of one
    grid run as one batch; the RoPE table and mask depend on the grid only: made once per grid and
    device (``prepare``)."""

    def __init__(self, encoder: DenseMaskQwen35VisionEncoder, *, image_grid: int):
        super().__init__()
        if not isinstance(encoder, DenseMaskQwen35VisionEncoder):
            raise TypeError(f"Qwen35EncoderChunk needs the encoder of with_cpu_paths, got {type(encoder).__name__}")
        self.patch_embed, self.pos_embed, self.layers = encoder.patch_embed, encoder.pos_embed, encoder.layers
        object.__setattr__(self, "encoder", encoder)  # unregistered: its helpers and config
        self.is_first = self.is_last = True
        self.layer_range = (0, len(encoder.layers))
        self._constants: dict = {}
        device = next(encoder.parameters()).device
        if device.type != "meta":  # made now, not in a training step's first forward
            self.prepare([(image_grid, image_grid)], device)

    def prepare(self, grids, device) -> None:
        """Build the geometry of images of these grids on ``device`` (before a step's actions)."""
        for g in set(grids):
            self._geometry(g, device)

    def forward(self, x: torch.Tensor, grids: tuple[tuple[int, int], ...]) -> torch.Tensor:
        return per_grid(x, grids, self._run)

    def _run(self, images: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """``n`` images of one grid, ``(n, patches, patch_dim)`` in raster order -> flat rows out."""
        enc, (n, P, _) = self.encoder, images.shape
        patches = block_order(images.flatten(0, 1), grid, enc.spatial_merge_size)
        h = enc.patch_embed(patches.to(enc.patch_embed.weight.dtype))
        pos = _compute_learned_pos_embeds(enc.pos_embed, [[1, *grid]], P, enc.num_grid_per_side, enc.spatial_merge_size, enc.config.dim)
        rope, mask = self._geometry(grid, images.device)
        return enc.blocks(h + pos, rope.expand(n, *rope.shape[1:]), mask.expand(n, *mask.shape[1:])).flatten(0, 1)

    def _geometry(self, grid: tuple[int, int], device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (grid, str(device))
        if key not in self._constants:
            enc = self.encoder
            gh, gw = grid
            freq = enc.rotary_pos_emb(max(gh, gw))
            rope = _compute_2d_rope_cache(freq, [[1, gh, gw]], gh * gw, enc.spatial_merge_size, enc.config.dim // enc.config.num_heads)
            self._constants[key] = rope, torch.ones(1, gh * gw, gh * gw, dtype=torch.bool, device=device)
        return self._constants[key]


def encoder_chunks(part: nn.Module, chunk_ranges, local, *, image_grid: int) -> dict[int, Qwen35EncoderChunk]:
    """Stage 0's encoder chunk (the co-located layout's one chunk holding the whole ViT)."""
    if len(chunk_ranges) != 1 or list(local) != [0]:
        raise ConfigError("Qwen3.5 runs its vision encoder as one chunk on stage 0 (co-located layout); the separated layout is not mapped")
    return {0: Qwen35EncoderChunk(part.vision_encoder, image_grid=image_grid)}
