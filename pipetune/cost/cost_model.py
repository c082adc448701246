"""Stage latencies of packed micro-batches, read off a latency table (PipeTune App. A.4).

For micro-batch ``j`` with documents ``l_i`` (``T`` tokens, ``n`` images) on stage ``s`` of
``L_s`` layers::

    fwd[j, s] = L_s * (rest(T) + sum_i attention(l_i)) + [s first](embedding(T) + projector(n))
                + [s last] head(T)                                   (bwd alike, bwd curves)
    encoder[j] = encoder(n)          # stage 0, before fwd[j, 0]; movable when the ViT is frozen

A trained ViT adds its backward to ``bwd[j, 0]`` and keeps its activations on stage 0 from the
micro-batch's forward to its backward: ``vit_activation_bytes_per_image`` per image, derived from
the encoder's shapes (latency tables hold no such entry). With ``recompute_encoder`` only each ViT
layer's input is kept and the backward re-runs the encoder's forward first (its time is added).

Lookups interpolate linearly between grid points. Below the grid they take the first point (a
call never costs less than the smallest measured one; zero images cost nothing). Above it they
scale the last point by the component's FLOPs growth (quadratic pair count for attention,
linear otherwise) and are counted in ``StageCosts.extrapolated``. Every component is multiplied by
its calibration scale (``LatencyTable.scales``), and each stage call pays the table's fixed
overhead (``LatencyTable.overhead``, zero unless calibrated).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipetune.config.model import ModelConfig
from pipetune.cost.layout import StageLayout
from pipetune.cost.table import Curve, LatencyTable
from pipetune.data.samples import SampleTable
from pipetune.packing.flops import attention_pairs
from pipetune.packing.packing import Packing

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class MicroBatchShapes:
    """What the cost model needs of ``m`` micro-batches: document lengths and image counts."""

    doc_lengths: np.ndarray
    doc_mb: np.ndarray
    tokens: np.ndarray
    images: np.ndarray

    @classmethod
    def from_packing(cls, table: SampleTable, packing: Packing) -> "MicroBatchShapes":
        order = packing.order
        m = packing.num_micro_batches
        doc_mb = np.repeat(np.arange(m), np.diff(packing.ptr))
        lengths = table.lengths[order]
        return cls(
            doc_lengths=lengths,
            doc_mb=doc_mb,
            tokens=np.bincount(doc_mb, weights=lengths, minlength=m).astype(np.int64),
            images=np.bincount(doc_mb, weights=table.num_images[order], minlength=m).astype(np.int64),
        )

    @property
    def num_micro_batches(self) -> int:
        return len(self.tokens)

    def take(self, idx: np.ndarray) -> "MicroBatchShapes":
        """The micro-batches ``idx`` (in that order), renumbered ``0..len(idx)-1``."""
        idx = np.asarray(idx, dtype=np.int64)
        new = np.full(self.num_micro_batches, -1, np.int64)
        new[idx] = np.arange(len(idx))
        keep = new[self.doc_mb] >= 0
        return MicroBatchShapes(self.doc_lengths[keep], new[self.doc_mb[keep]], self.tokens[idx], self.images[idx])


@dataclass(frozen=True)
class StageCosts:
    """Per micro-batch (rows) and stage (columns): seconds and bytes. ``p2p`` is one message
    across one stage boundary (forward activation or backward gradient; same size)."""

    fwd: np.ndarray
    bwd: np.ndarray
    encoder: np.ndarray
    activation_bytes: np.ndarray
    image_feature_bytes: np.ndarray
    p2p: np.ndarray
    extrapolated: int
    encoder_activation_bytes: np.ndarray


def vit_activation_bytes_per_image(model: ModelConfig, tp: int, dtype_bytes: int, *, recompute: bool = False) -> float:
    """Bytes a trained ViT keeps per image for its backward (FlashAttention, no softmax matrix):
    per layer and patch the inputs of its matmuls and elementwise ops, ``8 dim + 2 ffn_dim``
    values split over ``tp`` ranks; with ``recompute``, each layer's input plus one layer's full set."""
    enc = model.encoder
    if enc is None or enc.frozen:
        return 0.0
    per_layer = dtype_bytes * enc.patches_per_image * (8 * enc.dim + 2 * enc.ffn_dim) / tp
    if recompute:
        return enc.n_layers * dtype_bytes * enc.patches_per_image * enc.dim / tp + per_layer
    return enc.n_layers * per_layer


def _growth(x: np.ndarray, kind: str) -> np.ndarray:
    return attention_pairs(x) if kind == "seq_len" else x.astype(np.float64)


def lookup(curve: Curve, x: np.ndarray, which: str) -> tuple[np.ndarray, int]:
    """Curve value at ``x`` (see module doc for below/above the grid); returns (values, # extrapolated)."""
    x = np.asarray(x, dtype=np.float64)
    vals = curve.fwd if which == "fwd" else curve.bwd
    out = np.interp(x, curve.grid, vals)
    above = x > curve.grid[-1]
    if above.any():
        out[above] = vals[-1] * _growth(x[above], curve.x) / _growth(curve.grid[-1:], curve.x)
    out[x <= 0] = 0.0
    return out, int(above.sum())


class CostModel:
    """Vectorised stage-latency estimates for one model, table and stage layout."""

    def __init__(self, table: LatencyTable, layout: StageLayout, *, recompute_encoder: bool = False):
        if layout.num_layers != table.model.backbone.n_layers:
            raise ValueError(
                f"stage layout covers {layout.num_layers} layers but model {table.model.name!r} has "
                f"{table.model.backbone.n_layers}"
            )
        self.table = table
        self.layout = layout
        self.layers = np.asarray(layout.layers_per_stage(), dtype=np.float64)
        self.dtype_bytes = DTYPE_BYTES.get(table.dtype, 2)
        enc = table.model.encoder
        self.encoder_trainable = enc is not None and not enc.frozen
        self.beyond_grid: dict[str, float] = {}  # component -> largest size looked up past its grid
        self.recompute_encoder = recompute_encoder and self.encoder_trainable
        self.encoder_bytes_per_image = vit_activation_bytes_per_image(
            table.model, table.tp, self.dtype_bytes, recompute=self.recompute_encoder
        )

    def with_layout(self, layout: StageLayout) -> "CostModel":
        """The same table and options on another stage layout."""
        return CostModel(self.table, layout, recompute_encoder=self.recompute_encoder)

    @property
    def num_stages(self) -> int:
        return self.layout.num_stages

    def _curve(self, name: str, x: np.ndarray, which: str) -> tuple[np.ndarray, int]:
        if name not in self.table.curves:
            return np.zeros(len(x)), 0
        values, n = lookup(self.table.curves[name], x, which)
        if n:
            self.beyond_grid[name] = max(self.beyond_grid.get(name, 0.0), float(np.max(x)))
        return values, n

    def components(self, shapes: MicroBatchShapes) -> tuple[dict[str, dict[str, np.ndarray]], int]:
        """Unscaled contribution of each table component to each (micro-batch, stage) latency:
        ``{component: {"fwd": [m, S], "bwd": [m, S]}}``, and how many lookups were extrapolated.
        The encoder's entry is its own stage-0 work (``[m, S]``, zero off stage 0)."""
        m, S = shapes.num_micro_batches, self.num_stages
        out: dict[str, dict[str, np.ndarray]] = {}
        extrapolated = 0
        for which in ("fwd", "bwd"):
            attn, n1 = self._curve("attention", shapes.doc_lengths, which)
            per_mb = np.bincount(shapes.doc_mb, weights=attn, minlength=m)
            rest, n2 = self._curve("rest", shapes.tokens, which)
            extrapolated += n1 + n2
            out.setdefault("attention", {})[which] = per_mb[:, None] * self.layers[None, :]
            out.setdefault("rest", {})[which] = rest[:, None] * self.layers[None, :]
            for name, stage, x in (
                ("embedding", 0, shapes.tokens),
                ("projector", 0, shapes.images),
                ("head", S - 1, shapes.tokens),
                ("encoder", 0, shapes.images),
            ):
                v, n = self._curve(name, x, which)
                extrapolated += n
                col = np.zeros((m, S))
                col[:, stage] = v
                out.setdefault(name, {})[which] = col
        return out, extrapolated

    def activation_bytes(self, shapes: MicroBatchShapes) -> np.ndarray:
        """Saved activation bytes per (micro-batch, stage); no latency lookups (memory probes use it)."""
        mem = self.table.memory
        act = shapes.tokens[:, None] * (self.layers[None, :] * mem["layer_bytes_per_token"])
        act[:, 0] += shapes.tokens * mem["embedding_bytes_per_token"] + shapes.images * mem["projector_bytes_per_image"]
        act[:, -1] += shapes.tokens * mem["head_bytes_per_token"]
        return act

    def stage_costs(self, shapes: MicroBatchShapes) -> StageCosts:
        m, S = shapes.num_micro_batches, self.num_stages
        parts, extrapolated = self.components(shapes)
        fwd = np.zeros((m, S))
        bwd = np.zeros((m, S))
        fwd += self.table.fixed("fwd")
        bwd += self.table.fixed("bwd")
        for name, p in parts.items():
            if name != "encoder":
                fwd += self.table.scale(name) * p["fwd"]
                bwd += self.table.scale(name) * p["bwd"]
        encoder = self.table.scale("encoder") * parts["encoder"]["fwd"][:, 0]
        if self.encoder_trainable:
            bwd[:, 0] += self.table.scale("encoder") * parts["encoder"]["bwd"][:, 0]
            if self.recompute_encoder:
                bwd[:, 0] += encoder
        mem = self.table.memory
        act = self.activation_bytes(shapes)
        enc_act = shapes.images * self.encoder_bytes_per_image
        act[:, 0] += enc_act
        msg_bytes = shapes.tokens * self.table.model.backbone.dim * self.dtype_bytes
        p2p = self.table.p2p["latency_s"] + msg_bytes / self.table.p2p["bytes_per_s"]
        return StageCosts(
            fwd=fwd,
            bwd=bwd,
            encoder=encoder,
            activation_bytes=act,
            image_feature_bytes=shapes.images * mem["image_feature_bytes"],
            p2p=p2p if S > 1 else np.zeros(m),
            extrapolated=extrapolated,
            encoder_activation_bytes=enc_act,
        )
