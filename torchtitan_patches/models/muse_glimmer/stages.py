"""TorchTitan model parts as the backbone stages and encoder chunks ``PlanExecutor`` runs.

TorchTitan's pipelining split (``ModelSpec.pipelining_fn``) gives each rank its model parts: the
whole model class with the modules of other stages set to ``None``, so ``forward`` runs only what
the part holds. ``TitanStage`` calls that forward with pipetune's packed micro-batch (tokens or the
received hidden state, per-document positions, varlen document metadata).

The vision encoder runs as the plan's own encoder actions, apart from stage 0's forward, which
TorchTitan's Muse Glimmer model runs inside ``forward`` (``_get_vision_features``: encoder, then
adapter). ``TitanEncoderChunk`` runs the encoder, or one chunk of it; stage 0's forward then gets
the features through an instance-level ``_get_vision_features`` for the duration of the call,
which applies the (trained) adapter, as the model's own method does, so adapter and projection
gradients are unchanged.

Chunks (DIP's separated layout): a chunk is a contiguous range of the ViT's blocks. TorchTitan's
splitter keeps or drops whole top-level modules (``_split_module`` matches ``layers.3`` only for a
top-level ``ModuleDict``/``ModuleList``: a nested fqn such as ``vision_encoder.layers.3`` drops
the whole encoder), so a rank's model part keeps ``vision_encoder`` and ``keep_encoder_chunks``
then removes, before the part is materialised, the blocks of chunks on other ranks (and the patch
embedding / positions / ``ln_pre`` unless the rank holds chunk 0, ``ln_post`` unless it holds the
last). Parameter names stay those of the whole model, so checkpoints and optimizer state keep
TorchTitan's fqns. Muse Glimmer's encoder ``forward`` runs all phases at once (embedding, window
permutation, all blocks, un-permutation, norm, pixel shuffle), so a partial chunk runs them
itself, through the encoder's own helpers: the first chunk embeds and permutes, every chunk
uses the 2D RoPE table and masks of its images' grids (a function of the grid, no parameters),
the last un-permutes, normalises and merges. Between chunks an image is its patches' hidden
states in the window-permuted order. A chunk holding the whole encoder (the co-located layout)
runs the same way: the encoder's own ``forward`` reads its grids on the host and rebuilds masks
and permutations every call (device syncs); the chunk builds them once per grid and device, before
the step's first action (``prepare``).

Images arrive as the loader's patch rows (Qwen-VL's layout, which Muse Glimmer's ``conv1``
reads) with their grids on the host, sorted by grid: images of one grid run as one batch (the
encoder's own ``forward`` pads every image to the largest and masks, which costs the largest
image's attention for every image).
"""

from __future__ import annotations

import torch
from torch import nn
from torchtitan.models.common import ComplexRoPE
from torchtitan.models.muse_glimmer.vision_encoder import MuseGlimmerVisionEncoder, _vision_token_permute, reorder_patch_vector

from torchtitan_patches.data.micro_batch import IMAGE_TOKEN_ID, ImageSpan
from torchtitan_patches.models.image_batches import Grid, per_grid

_UNREAD_GRID = torch.ones(1, 3, dtype=torch.long)


def keep_encoder_chunks(encoder: MuseGlimmerVisionEncoder, chunk_ranges, local) -> None:
    """Remove from ``encoder`` (in place, e.g. on the meta device before materialisation) all but
    the pieces of its chunks ``local`` (indices into ``chunk_ranges``, block ranges tiling its
    blocks): other chunks' blocks, the embedding pieces unless chunk 0 is local, ``ln_post``
    unless the last chunk is."""
    n = len(encoder.layers)
    if not chunk_ranges or chunk_ranges[0][0] != 0 or chunk_ranges[-1][1] != n or any(
            a[1] != b[0] for a, b in zip(chunk_ranges, chunk_ranges[1:])) or any(lo >= hi for lo, hi in chunk_ranges):
        raise ValueError(f"encoder chunk ranges {list(chunk_ranges)} do not tile the vision encoder's {n} blocks with non-empty chunks")
    keep = {str(i) for c in local for i in range(*chunk_ranges[c])}
    for key in [k for k in encoder.layers.keys() if k not in keep]:
        del encoder.layers[key]
    if 0 not in local:
        encoder.conv1_linear = encoder.ln_pre = encoder.positional_embedding_vlm = None
    if len(chunk_ranges) - 1 not in local:
        encoder.ln_post = None


class TitanEncoderChunk(nn.Module):
    """Blocks ``layers = (lo, hi)`` of a Muse Glimmer vision encoder of ``num_layers`` blocks, as an
    encoder chunk of the plan: images flat, patch rows ``(patches, patch_dim)`` in on the first
    chunk, else hidden states ``(patches, latent_dim)``; features ``(tokens, output_dim)`` out of
    the last chunk, else hidden states; ``grids`` gives each image's patch grid, in row order.
    ``encoder`` may hold other chunks' blocks too (a rank's model part holds all of its chunks);
    the chunk runs its own."""

    def __init__(self, encoder: MuseGlimmerVisionEncoder, layers: tuple[int, int], *, num_layers: int, image_grid: int):
        super().__init__()
        lo, hi = layers
        missing = [i for i in range(lo, hi) if str(i) not in encoder.layers]
        if missing or not 0 <= lo < hi <= num_layers:
            raise ValueError(f"encoder chunk of blocks {lo}..{hi - 1} (of {num_layers}): the encoder does not hold blocks {missing}")
        self.encoder = encoder
        self.layer_range = (lo, hi)
        self.is_first, self.is_last = lo == 0, hi == num_layers
        self.num_layers = num_layers
        self._constants: dict = {}
        device = encoder.rope_freq.inv_freq.device
        if device.type != "meta":  # made now, not in a training step's first forward (building them syncs the device)
            self.prepare([(image_grid, image_grid)], device)

    def prepare(self, grids, device) -> None:
        """Build the geometry of images of these grids on ``device`` (host work and uploads that
        the action loop must not do)."""
        for g in set(grids):
            self._geometry(g, 1, device)

    def forward(self, x: torch.Tensor, grids: tuple[Grid, ...]) -> torch.Tensor:
        return per_grid(x, grids, self._run)

    def _run(self, x: torch.Tensor, grid: Grid) -> torch.Tensor:
        """``n`` images of one grid, ``(n, patches, width)`` -> flat rows out."""
        enc, n = self.encoder, x.shape[0]
        gh, gw = grid
        perm, inv, rope, masks = self._geometry(grid, n, x.device)
        if self.is_first:
            dtype = enc.conv1_linear.weight.dtype
            patches = reorder_patch_vector(x.to(dtype), patch_size=enc.patch_size, patch_temporal=enc.patch_temporal)
            x = enc.conv1_linear(patches)
            x = enc.ln_pre(x + enc._get_pos_emb(gh, gw, x.device).to(dtype))  # as the encoder's forward adds it
            x = _vision_token_permute(x, perm) if perm is not None else x
        for i in range(*self.layer_range):
            x = enc.layers[str(i)](x, rope_cache=rope, rope_apply=ComplexRoPE.apply_rotary_emb, attention_mask=masks[self._global(i)])
        if not self.is_last:
            return x.flatten(0, 1)
        x = enc.ln_post(_vision_token_permute(x, inv) if inv is not None else x)
        return torch.cat([enc._pixel_shuffle_downsample(x[i], gh, gw) for i in range(n)])

    def _global(self, i: int) -> int:
        """1 when block ``i`` attends over the whole image (the last block and every
        ``sparse_attention_factor``-th, as ``MuseGlimmerVisionEncoder._layer_uses_global_attention``
        decides from the number of blocks, which a pruned encoder no longer holds), else 0."""
        return int(i == self.num_layers - 1 or (i + 1) % self.encoder.sparse_attention_factor == 0)

    def _geometry(self, grid: Grid, n: int, device) -> tuple:
        """Window permutation and its inverse (None without windows), RoPE table (in the permuted
        order) and (windowed, global) masks for ``n`` images of ``grid``, made by the encoder's own
        helpers as its ``forward`` makes them: once per grid and device for one image (``prepare``;
        the encoder's ``forward`` reads its grids on the host every call) and expanded to ``n``
        (views: no copy, no device work)."""
        key = (grid, str(device))
        if key not in self._constants:
            enc = self.encoder
            gh, gw = grid
            P = gh * gw
            rope = enc._make_2d_rope(gh, gw, device)[None, :, None]
            perm = inv = None
            win_id = torch.full((1, P), -1, device=device, dtype=torch.int32)
            if enc.sparse_attention_factor > 1:
                perm, inv, win_id = enc._compute_sparse_perm_winid([[1, gh, gw]], P, device)
                rope = _vision_token_permute(rope, perm)
            full, sparse = enc._build_padded_masks(torch.full((1,), P, device=device), win_id, P, device)
            self._constants[key] = perm, inv, rope, (sparse, full)
        perm, inv, rope, masks = self._constants[key]
        many = lambda t: t.expand(n, *t.shape[1:]) if t is not None else None  # noqa: E731
        return many(perm), many(inv), many(rope), tuple(map(many, masks))


def encoder_chunks(part: nn.Module, chunk_ranges, local, *, image_grid: int) -> dict[int, TitanEncoderChunk]:
    """The encoder chunks ``local`` of a model part whose ``vision_encoder`` was cut by
    ``keep_encoder_chunks`` (or holds the whole encoder: ``chunk_ranges`` one range)."""
    n = chunk_ranges[-1][1]
    return {c: TitanEncoderChunk(part.vision_encoder, tuple(chunk_ranges[c]), num_layers=n, image_grid=image_grid) for c in local}


class TitanStage(nn.Module):
    """One TorchTitan model part with the executor's stage interface."""

    def __init__(self, part: nn.Module, *, is_first: bool, is_last: bool):
        super().__init__()
        self.part = part
        self.is_first, self.is_last = is_first, is_last

    def forward(self, x, *, positions, masks, image_features: torch.Tensor | None = None, image_spans: tuple[ImageSpan, ...] = ()):
        if image_features is None:
            return self.part(x, positions, masks)
        part = self.part
        # the model's own hooks, for this call: features through the adapter only (the encoder ran
        # as its own actions), and the image tokens' spans as the host knows them (no device search)
        part._get_vision_features = lambda pixel_values, grid_thw: part.vision_adapter(pixel_values).unsqueeze(0)
        part._vision_spans = lambda vision_mask: [(0, start, n) for start, n, _ in image_spans]
        try:
            return part(x, positions, masks, pixel_values=image_features,
                        grid_thw=_UNREAD_GRID,  # the model's forward requires one; the features' hook above never reads it
                        special_tokens={"image_id": IMAGE_TOKEN_ID})
        finally:
            del part._get_vision_features, part._vision_spans
