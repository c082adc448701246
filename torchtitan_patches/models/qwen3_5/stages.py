"""Qwen3.5's stage and encoder chunk: how ``PlanExecutor`` runs a model part (package doc)."""

from __future__ import annotations


import einops
import numpy as np
import torch
from torch import nn
from torchtitan.models.common.attention import VarlenMetadata
from torchtitan.models.qwen3_5.model import Qwen35Model
from torchtitan.models.qwen3_5.vision_encoder import _compute_2d_rope_cache, _compute_learned_pos_embeds

from pipetune.config.model import ConfigError
from torchtitan_patches.data.micro_batch import ImageSpan
from torchtitan_patches.models.image_batches import per_grid
from torchtitan_patches.models.qwen3_5.cpu_paths import DenseMaskQwen35VisionEncoder
from torchtitan_patches.models.reference.vlm import scatter_spans


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
