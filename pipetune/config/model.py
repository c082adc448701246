"""Model shapes the planner needs: a LLaMA-style backbone, a ViT encoder and its MLP projector.

These are plain numbers, not modules: FLOPs, memory and latency estimates are functions of them,
and the runtime (``torchtitan_patches``) builds the real model from the same objects.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import MISSING, asdict, dataclass, fields

import numpy as np


class ConfigError(ValueError):
    """A model, encoder or hardware config (or a parallel degree) that cannot be used; says what to fix."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


_KINDS = {"int": "an integer", "float": "a finite number", "bool": "true or false", "str": "a string"}


def check_field_types(cfg, section: str) -> None:
    """Refuse fields of the wrong type (``n_layers = 4.5``, ``frozen = "no"``) before they reach arithmetic."""
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        ok = {
            "int": isinstance(v, int) and not isinstance(v, bool),
            "float": isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
            "bool": isinstance(v, bool),
            "str": isinstance(v, str),
        }.get(f.type, True)
        _require(ok, f"{section}.{f.name} must be {_KINDS.get(f.type)}, got {v!r}")


def _check_shape(cfg, section: str, positive: tuple[str, ...], divides: tuple[str, str]) -> None:
    """Every field in ``positive`` > 0, and ``divides[1]`` divides ``divides[0]``."""
    for name in positive:
        _require(getattr(cfg, name) > 0, f"{section}.{name} must be > 0, got {getattr(cfg, name)}")
    a, b = divides
    _require(getattr(cfg, a) % getattr(cfg, b) == 0, f"{section}.{a}={getattr(cfg, a)} is not divisible by {b}={getattr(cfg, b)}")


@dataclass(frozen=True, kw_only=True)
class LinearAttentionConfig:
    """Which backbone layers mix tokens by linear attention (Gated DeltaNet, as Qwen3.5's are) and
    their recurrence's shapes. ``layers``: their indices (the other layers are full attention).

    The kernel (fla's chunked gated delta rule, and ``gated_delta_cpu``) cuts every document into
    ``chunk``-token chunks, the last one padded, so a document of ``l`` tokens costs as
    ``ceil(l / chunk) * chunk`` tokens: linear in its length, not quadratic. The planner charges a
    linear-attention layer's projections and FFN as a full-attention layer's (``layer_params``).
    """

    layers: tuple[int, ...]
    n_key_heads: int
    n_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    chunk: int = 64

    def __post_init__(self) -> None:
        layers = self.layers
        _require(
            isinstance(layers, (list, tuple)) and len(layers) > 0 and all(isinstance(i, int) and not isinstance(i, bool) for i in layers),
            f"backbone.linear_attention.layers must be a non-empty list of layer indices, got {layers!r}",
        )
        _require(len(set(layers)) == len(layers), f"backbone.linear_attention.layers lists a layer twice: {list(layers)}")
        object.__setattr__(self, "layers", tuple(sorted(layers)))
        check_field_types(self, "backbone.linear_attention")
        positive = ("n_key_heads", "n_value_heads", "key_head_dim", "value_head_dim", "conv_kernel", "chunk")
        _check_shape(self, "backbone.linear_attention", positive, ("n_value_heads", "n_key_heads"))

    @classmethod
    def from_value(cls, v) -> "LinearAttentionConfig":
        """From a TOML / JSON table, refusing unknown or missing keys by name."""
        if isinstance(v, cls):
            return v
        _require(isinstance(v, dict), f"backbone.linear_attention must be a table of {cls.__name__} fields, got {v!r}")
        known = {f.name for f in fields(cls)}
        _require(not set(v) - known, f"backbone.linear_attention: unknown keys {sorted(set(v) - known)}; allowed: {sorted(known)}")
        missing = sorted(f.name for f in fields(cls) if f.name not in v and f.default is MISSING)
        _require(not missing, f"backbone.linear_attention: missing keys {missing}")
        return cls(**v)

    def chunked(self, lengths) -> np.ndarray:
        """Tokens the kernel computes for documents of ``lengths``: each rounded up to whole chunks."""
        return np.ceil(np.asarray(lengths, dtype=np.float64) / self.chunk) * self.chunk


@dataclass(frozen=True, kw_only=True)
class BackboneConfig:
    """LLaMA-style decoder: RMSNorm, GQA attention with RoPE, SwiGLU FFN, untied output head.

    ``output_gate``: attention output multiplied by ``sigmoid(x W_g)`` (Muse Glimmer's ``o_gate``),
    one more ``dim x dim`` matmul per layer. ``linear_attention``: the layers that mix tokens by
    linear attention instead (none: every layer is full attention).
    """

    n_layers: int
    dim: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    output_gate: bool = False
    linear_attention: LinearAttentionConfig | None = None

    def __post_init__(self) -> None:
        check_field_types(self, "backbone")
        _check_shape(self, "backbone", ("n_layers", "dim", "ffn_dim", "n_heads", "n_kv_heads", "vocab_size"), ("dim", "n_heads"))
        _require(
            self.n_heads % self.n_kv_heads == 0,
            f"backbone.n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}",
        )
        if self.linear_attention is not None:
            la = LinearAttentionConfig.from_value(self.linear_attention)
            object.__setattr__(self, "linear_attention", la)
            outside = [i for i in la.layers if not 0 <= i < self.n_layers]
            _require(not outside, f"backbone.linear_attention.layers {outside} are not layers of this {self.n_layers}-layer backbone "
                                  f"(indices 0 .. {self.n_layers - 1})")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Indices of the linear-attention layers (empty: all layers are full attention)."""
        return self.linear_attention.layers if self.linear_attention is not None else ()

    @property
    def n_full_layers(self) -> int:
        return self.n_layers - len(self.linear_layers)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer's matmuls (norm weights are negligible and left out)."""
        attn = self.dim * (self.dim + 2 * self.kv_dim) + self.dim * self.dim
        gate = self.dim * self.dim if self.output_gate else 0
        return attn + gate + 3 * self.dim * self.ffn_dim


@dataclass(frozen=True, kw_only=True)
class EncoderConfig:
    """ViT vision encoder (SigLIP-style: GELU MLP with two matrices, full attention) + projector.

    The ViT runs over ``patches_per_image`` = (image_size / patch_size) ** 2 patches; a spatial
    merge (pixel shuffle) of ``merge`` x ``merge`` neighbouring patches then hands
    ``tokens_per_image`` = patches / merge ** 2 tokens of width ``dim * merge ** 2`` to the projector
    (DIP: 676 patches -> 169 tokens). So the encoder's cost scales with patches, the backbone's with
    tokens. The projector is a 2-layer MLP (``dim * merge ** 2`` -> backbone dim -> backbone dim) and
    is always trained; ``frozen`` refers to the ViT only, which is what lets its forward be
    pre-computed. ``projector_hidden`` sets other hidden widths (Muse Glimmer's adapter + projection
    is ``merged_dim -> 128 -> 128 -> dim``: ``projector_hidden = [128, 128]``).
    ``patch_temporal`` frames of a still image are embedded together (Qwen-VL / Muse Glimmer
    style), so a patch has ``patch_dim = channels * patch_temporal * patch_size ** 2`` inputs.
    """

    n_layers: int
    dim: int
    ffn_dim: int
    n_heads: int
    image_size: int
    patch_size: int
    channels: int = 3
    frozen: bool = True
    norm_eps: float = 1e-6
    merge: int = 1
    patch_temporal: int = 1
    projector_hidden: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_field_types(self, "encoder")
        _check_shape(
            self, "encoder", ("n_layers", "dim", "ffn_dim", "n_heads", "image_size", "patch_size", "channels", "merge", "patch_temporal"), ("dim", "n_heads")
        )
        if self.projector_hidden is not None:
            hidden = self.projector_hidden
            _require(
                isinstance(hidden, (list, tuple)) and all(isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in hidden),
                f"encoder.projector_hidden must be a list of positive integers (hidden widths), got {hidden!r}",
            )
            object.__setattr__(self, "projector_hidden", tuple(hidden))
        _require(
            self.image_size % self.patch_size == 0,
            f"encoder.image_size={self.image_size} is not a multiple of patch_size={self.patch_size}",
        )
        side = self.image_size // self.patch_size
        _require(side % self.merge == 0, f"encoder.merge={self.merge} does not divide the {side} x {side} patch grid")

    @property
    def patches_per_image(self) -> int:
        """Tokens the ViT itself runs over."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        """Tokens handed to the backbone after the spatial merge."""
        return self.patches_per_image // self.merge**2

    @property
    def merged_dim(self) -> int:
        """Width of a merged token: the projector's input."""
        return self.dim * self.merge**2

    @property
    def patch_dim(self) -> int:
        """Inputs of the patch embedding per patch."""
        return self.channels * self.patch_temporal * self.patch_size**2

    @property
    def layer_params(self) -> int:
        return 4 * self.dim * self.dim + 2 * self.dim * self.ffn_dim


_LATER_FIELDS = {"backbone": {"output_gate": False, "linear_attention": None}, "encoder": {"patch_temporal": 1, "projector_hidden": None}}


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A VLM: backbone plus (optionally) a vision encoder; text-only models have ``encoder=None``."""

    name: str
    backbone: BackboneConfig
    encoder: EncoderConfig | None = None

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and self.name != "", f"model name must be a non-empty string, got {self.name!r}")

    @property
    def tokens_per_image(self) -> int:
        return self.encoder.tokens_per_image if self.encoder is not None else 0

    @property
    def projector_params(self) -> int:
        """Weights of the projector MLP, ``merged_dim -> hidden... -> backbone dim`` (0 without encoder)."""
        if self.encoder is None:
            return 0
        hidden = (self.backbone.dim,) if self.encoder.projector_hidden is None else self.encoder.projector_hidden
        widths = (self.encoder.merged_dim, *hidden, self.backbone.dim)
        return sum(a * b for a, b in zip(widths[:-1], widths[1:]))

    def check_tp(self, tp: int) -> None:
        """Tensor parallelism splits attention by heads: refuse a degree that does not divide every
        head count (it would give a wrong plan, not an error, further on)."""
        _require(isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1, f"TP must be an integer >= 1, got {tp!r}")
        heads = {"backbone.n_heads": self.backbone.n_heads, "backbone.n_kv_heads": self.backbone.n_kv_heads}
        if self.encoder is not None:
            heads["encoder.n_heads"] = self.encoder.n_heads
        la = self.backbone.linear_attention
        if la is not None:
            heads |= {"backbone.linear_attention.n_key_heads": la.n_key_heads, "backbone.linear_attention.n_value_heads": la.n_value_heads}
        bad = [f"{k}={v}" for k, v in heads.items() if v % tp]
        if bad:
            fits = [d for d in range(1, min(heads.values()) + 1) if all(v % d == 0 for v in heads.values())]
            raise ConfigError(
                f"model {self.name!r}: TP={tp} does not divide {', '.join(bad)}; tensor parallelism splits attention "
                f"by heads, so choose a TP that divides every head count: {fits}"
            )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        enc = d.get("encoder")
        return cls(
            name=d["name"],
            backbone=BackboneConfig(**d["backbone"]),
            encoder=EncoderConfig(**enc) if enc else None,
        )

    def fingerprint(self) -> str:
        """Stable hash of the shapes (not the name): latency tables are keyed on it. Fields added
        later (``_LATER_FIELDS``) count only when set, so tables made before they existed stay valid."""
        shapes = self.to_dict()
        shapes.pop("name")
        for section, defaults in _LATER_FIELDS.items():
            part = shapes.get(section) or {}
            for k, default in defaults.items():
                if k in part and part[k] == default:
                    part.pop(k)
        blob = json.dumps(shapes, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
