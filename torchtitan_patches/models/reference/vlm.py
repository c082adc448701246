"""A LLaVA-style VLM from TorchTitan blocks: frozen ViT -> 2-layer MLP projector -> LLaMA decoder.

Stages are built as TorchTitan builds pipeline stages: on the meta device first, then only this
rank's stages (and the encoder, on the rank of stage 0) are materialised on its device. Each piece
(embedding, projector, decoder layer ``i``, final norm, head, encoder) is initialised from its own
RNG stream, seeded by ``(seed, piece name)``, so a stage holds the same weights whichever other
stages are built beside it: a pipelined run and the single-process reference (``build_vlm``, the
whole backbone as one stage) start from identical weights.
The ViT is its own module: PipeTune co-locates it with stage 0 and may run it early (encoder
pre-computation); DIP cuts it into chunks of its own, contiguous layer ranges spread over all ranks
(``build_encoder_chunks``; seeded per piece too, so any cut holds the reference's weights). It
takes images as flat patch rows with their grids (the loader's layout) and gives, per image,
``tokens_per_image`` rows of ``merged_dim`` features (after the optional spatial merge of
``merge`` x ``merge`` neighbouring patches) that stage 0 projects and scatters into the sequence;
between chunks it hands on ``patches_per_image`` rows of width ``dim`` per image. Its learned
positions are one table for the standard image, so every image must have the standard grid
(the profiler's and the tests' model; TorchTitan's VLMs take images at their own resolution).
"""

from __future__ import annotations

import hashlib
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchtitan.models.common import Embedding, Linear
from torchtitan.models.common.attention import VarlenMetadata
from torchtitan.models.common.nn_modules import LayerNorm, RMSNorm

from pipetune.config.model import EncoderConfig, ModelConfig
from torchtitan_patches.data.micro_batch import IGNORE_INDEX, ImageSpan
from torchtitan_patches.models.reference.blocks import decoder_layer_config, no_rope, vit_layer_config


_SMALL = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}


def _seeded_init(seed: int, name: str, init, device: torch.device) -> None:
    """Run ``init()`` (for tensors on ``device``) on an RNG stream of its own, derived from
    ``(seed, name)`` only; the global RNG state is left as it was (only this device's is touched)."""
    stream = int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest(), "little") >> 1
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(stream)
        init()


class VisionEncoder(nn.Module):
    """Patch embedding + learned positions + ViT layers + final LayerNorm (SigLIP layout), then a
    ``merge`` x ``merge`` pixel shuffle of neighbouring patches into one token each (identity at 1).

    ``layers = (lo, hi)`` builds one chunk of it (DIP's separated layout): ViT layers ``lo .. hi-1``;
    the first chunk (``lo == 0``) also embeds patches (a linear map of each patch's pixels, the
    ``patch_size`` stride convolution) and positions and takes patch rows ``(N * patches,
    patch_dim)``; the last (``hi == n_layers``) also applies the final norm and the merge and
    returns features ``(N * tokens_per_image, merged_dim)``; other boundaries carry ``(N *
    patches_per_image, dim)``. Default: the whole encoder."""

    def __init__(self, e: EncoderConfig, tp: int = 1, layers: tuple[int, int] | None = None):
        super().__init__()
        lo, hi = layers if layers is not None else (0, e.n_layers)
        if not 0 <= lo < hi <= e.n_layers:
            raise ValueError(f"encoder layers {lo}..{hi - 1} are not a non-empty range of the encoder's {e.n_layers} layers")
        self.config = e
        self.first_layer, self.layer_range = lo, (lo, hi)
        self.is_first, self.is_last = lo == 0, hi == e.n_layers
        # channels x patch_temporal input planes: the stride convolution of a patch row's ``patch_temporal`` frames
        self.patch_embed = (nn.Conv2d(e.channels * e.patch_temporal, e.dim, kernel_size=e.patch_size, stride=e.patch_size)
                            if self.is_first else None)
        self.pos_embed = nn.Parameter(torch.empty(e.patches_per_image, e.dim)) if self.is_first else None
        self.layers = nn.ModuleList(vit_layer_config(e, tp).build() for _ in range(lo, hi))
        self.post_norm = LayerNorm.Config(normalized_shape=e.dim, eps=e.norm_eps).build() if self.is_last else None
        if e.frozen:
            self.requires_grad_(False)
        if not next(self.parameters()).is_meta:  # built directly (the profiler), not through build_stages
            self.init_weights(0)

    def init_weights(self, seed: int) -> None:
        dev = next(self.parameters()).device
        if self.is_first:
            _seeded_init(seed, "encoder.patch_embed", self.patch_embed.reset_parameters, dev)
            _seeded_init(seed, "encoder.pos_embed", lambda: nn.init.normal_(self.pos_embed, std=0.02), dev)
        for k, layer in enumerate(self.layers):
            _seeded_init(seed, f"encoder.layers.{self.first_layer + k}", layer.init_states, dev)
        if self.is_last:
            _seeded_init(seed, "encoder.post_norm", self.post_norm.init_states, dev)

    def prepare(self, grids, device) -> None:
        """Nothing to build ahead of a step: the positions are a parameter table, attention has no mask."""

    def forward(self, x: torch.Tensor, grids: tuple[tuple[int, int], ...]) -> torch.Tensor:
        e = self.config
        side = e.image_size // e.patch_size
        if any(g != (side, side) for g in grids):
            raise ValueError(f"this encoder's learned positions cover the {side} x {side} patch grid only; got image grids "
                             f"{sorted(set(grids))}: resize images to the standard size (dataloader keep_aspect=False)")
        n = len(grids)
        x = x.view(n, e.patches_per_image, -1)
        if self.is_first:
            x = F.linear(x, self.patch_embed.weight.flatten(1), self.patch_embed.bias) + self.pos_embed
        for layer in self.layers:
            x = layer(x, rope_cache=x.new_zeros(1), rope_apply=no_rope, attention_mask=None)
        if not self.is_last:
            return x.flatten(0, 1)
        x = self.post_norm(x)
        m = e.merge
        x = x.view(n, side // m, m, side // m, m, -1).permute(0, 1, 3, 2, 4, 5)
        return x.reshape(n * e.tokens_per_image, e.merged_dim)


class Projector(nn.Module):
    """Encoder features -> backbone embeddings: Linear, GELU, Linear (trained); ``tp > 1`` builds
    one tensor-parallel rank's shard (for profiling). Call ``init_weights`` before use."""

    def __init__(self, encoder_dim: int, dim: int, tp: int = 1):
        super().__init__()
        self.fc1 = Linear.Config(in_features=encoder_dim, out_features=dim // tp, bias=True, param_init=_SMALL).build()
        self.fc2 = Linear.Config(in_features=dim // tp, out_features=dim, bias=True, param_init=_SMALL).build()
        if not self.fc1.weight.is_meta:  # built directly (the profiler), not through build_stages
            self.init_weights()

    def init_weights(self) -> None:
        self.fc1.init_states()
        self.fc2.init_states()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(features)))


def scatter_spans(x: torch.Tensor, features: torch.Tensor, spans: tuple[ImageSpan, ...]) -> torch.Tensor:
    """``x`` ``(1, L, dim)`` with ``features`` ``(n, dim)`` written, in order, over the token
    ``spans`` (``(start, length)``, host ints: no device search for the image tokens)."""
    if sum(n for _, n, _ in spans) != features.shape[0]:
        raise ValueError(f"the image token spans hold {sum(n for _, n, _ in spans)} positions for {features.shape[0]} image feature tokens")
    at = 0
    for start, n, _ in spans:
        x[0, start:start + n] = features[at:at + n]
        at += n
    return x


class BackboneStage(nn.Module):
    """Decoder layers ``[first_layer, last_layer)``; the first stage (``first_layer == 0``) also
    embeds tokens and projects image features, the last applies the final norm and the output head.

    ``forward`` returns hidden states ``(1, T, dim)``, or logits ``(1, T, vocab)`` on the last stage.
    Built by ``build_stages`` (parameters uninitialised until ``init_weights``).
    """

    def __init__(self, model: ModelConfig, layers: tuple[int, int], *, max_seq_len: int, attention_backend: str = "auto"):
        super().__init__()
        b = model.backbone
        lo, hi = layers
        self.first_layer = lo
        first, last = lo == 0, hi == b.n_layers
        self.tok_embeddings = Embedding.Config(num_embeddings=b.vocab_size, embedding_dim=b.dim, param_init=_SMALL).build() if first else None
        self.projector = Projector(model.encoder.merged_dim, b.dim) if first and model.encoder is not None else None
        self.layers = nn.ModuleList(
            decoder_layer_config(b, max_seq_len=max_seq_len, attention_backend=attention_backend).build() for _ in range(lo, hi)
        )
        self.norm = RMSNorm.Config(normalized_shape=b.dim, eps=b.norm_eps).build() if last else None
        self.lm_head = Linear.Config(in_features=b.dim, out_features=b.vocab_size, param_init=_SMALL).build() if last else None

    def init_weights(self, seed: int) -> None:
        """Every piece from its own stream (see the module doc): the same weights in any split."""
        dev = next(self.parameters()).device
        for name, piece in (("tok_embeddings", self.tok_embeddings), ("norm", self.norm), ("lm_head", self.lm_head)):
            if piece is not None:
                _seeded_init(seed, name, piece.init_states, dev)
        if self.projector is not None:
            _seeded_init(seed, "projector", self.projector.init_weights, dev)
        for k, layer in enumerate(self.layers):
            _seeded_init(seed, f"layers.{self.first_layer + k}", layer.init_states, dev)

    @property
    def is_first(self) -> bool:
        return self.tok_embeddings is not None

    @property
    def is_last(self) -> bool:
        return self.lm_head is not None

    def forward(
        self,
        x: torch.Tensor,
        *,
        positions: torch.Tensor,
        masks: VarlenMetadata,
        image_features: torch.Tensor | None = None,
        image_spans: tuple[ImageSpan, ...] = (),
    ) -> torch.Tensor:
        if self.is_first:
            x = self.tok_embeddings(x)
            if image_features is not None and image_features.shape[0] > 0:
                if self.projector is None:
                    raise ValueError("image features given to a text-only model")
                projected = self.projector(image_features).to(x.dtype)
                x = scatter_spans(x, projected, image_spans)
        for layer in self.layers:
            x = layer(x, masks, positions)
        if self.is_last:
            x = self.lm_head(self.norm(x))
        return x


def build_stages(
    model: ModelConfig,
    layer_ranges: list[tuple[int, int]],
    local: list[int],
    *,
    max_seq_len: int,
    seed: int = 0,
    device: torch.device | str = "cpu",
    attention_backend: str = "auto",
    colocated_encoder: bool = True,
) -> tuple[VisionEncoder | None, dict[int, BackboneStage]]:
    """This rank's stages ``local`` (indices into ``layer_ranges``) and, when it holds stage 0 of
    a model with one and ``colocated_encoder`` (PipeTune's layout; DIP's separated layout builds
    ``build_encoder_chunks`` instead), the vision encoder: built on the meta device, then only
    these materialised on ``device`` and initialised (``device="meta"`` leaves them
    unmaterialised, for sizing)."""
    _check_cut(layer_ranges, local, model.backbone.n_layers, "backbone", "stage")
    with torch.device("meta"):
        encoder = VisionEncoder(model.encoder) if model.encoder is not None and 0 in local and colocated_encoder else None
        stages = {s: BackboneStage(model, tuple(layer_ranges[s]), max_seq_len=max_seq_len, attention_backend=attention_backend)
                  for s in local}
    for module in (*stages.values(), encoder):
        if module is not None:
            _materialise(module, seed, device)
    return encoder, stages


def build_encoder_chunks(
    model: ModelConfig,
    chunk_ranges: list[tuple[int, int]],
    local: list[int],
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> dict[int, VisionEncoder]:
    """This rank's encoder chunks ``local`` (indices into ``chunk_ranges``, the encoder's layer
    ranges of DIP's separated layout), built and initialised as ``build_stages`` builds stages."""
    if model.encoder is None:
        raise ValueError(f"model {model.name!r} has no vision encoder to cut into chunks")
    _check_cut(chunk_ranges, local, model.encoder.n_layers, "encoder", "chunk")
    with torch.device("meta"):
        chunks = {c: VisionEncoder(model.encoder, layers=tuple(chunk_ranges[c])) for c in local}
    for chunk in chunks.values():
        _materialise(chunk, seed, device)
    return chunks


def _check_cut(ranges, local, n: int, module: str, piece: str) -> None:
    """``ranges`` must be non-empty, contiguous and cover the module's layers ``0 .. n-1``, and
    ``local`` index them."""
    if not ranges or ranges[0][0] != 0 or ranges[-1][1] != n or any(a[1] != b[0] for a, b in zip(ranges, ranges[1:])) or any(
            lo >= hi for lo, hi in ranges):
        raise ValueError(f"{piece} layer ranges {ranges} do not tile the {module}'s {n} layers with non-empty {piece}s")
    if any(not 0 <= s < len(ranges) for s in local):
        raise ValueError(f"{module} {piece}s {local} are not among the {len(ranges)} {piece}s")


def _materialise(module: nn.Module, seed: int, device: torch.device | str) -> None:
    """Meta-built ``module`` on ``device``, initialised by its per-piece seeded ``init_weights``
    (left on the meta device when ``device`` is meta)."""
    device = torch.device(device)
    if device.type != "meta":
        module.to_empty(device=device)
        module.init_weights(seed)


def build_vlm(model: ModelConfig, *, max_seq_len: int, seed: int = 0, device: torch.device | str = "cpu",
              attention_backend: str = "auto") -> tuple[VisionEncoder | None, BackboneStage]:
    """The single-process reference model: (vision encoder or None, whole backbone as one stage),
    with the same weights as any split built by ``build_stages`` from the same seed."""
    encoder, stages = build_stages(model, [(0, model.backbone.n_layers)], [0], max_seq_len=max_seq_len, seed=seed,
                                   device=device, attention_backend=attention_backend)
    return encoder, stages[0]


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies; the caller divides by the global label-token count."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
