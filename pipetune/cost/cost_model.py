"""Latencies of packed micro-batches on every chunk, read off a latency table (PipeTune App. A.4).

For micro-batch ``j`` with documents ``l_i`` (``T`` tokens) on backbone stage ``s`` of ``L_s``
layers, ``F_s`` of them full attention and ``N_s`` linear attention (``BackboneConfig.
linear_attention``)::

    fwd[j, s] = L_s * rest(T) + F_s * sum_i attention(l_i) + N_s * linear_attention(sum_i chunk(l_i))
                + [s first](embedding(T) + projector(n_j)) + [s last] head(T)    (bwd alike, bwd curves)

where ``chunk(l)`` rounds a document up to the linear-attention kernel's whole chunks. A full
attention layer's cost grows with each document's length squared, a linear one's with the tokens.

and for encoder sub-microbatch ``k`` (``pipetune.packing.sub_batches``; co-located: micro-batch
``k``'s ``n_k`` images; separated: ``B`` images, the padded size) on encoder chunk ``c`` of
``L_c`` of the encoder's ``L`` layers::

    encoder[k, c] = encoder(images_k) * L_c / L          (encoder_bwd alike; zero when frozen)

The table's ``encoder`` curve is the whole encoder by image count, so a chunk's share is taken
per layer (the patch embedding and the final merge are charged like any layer: a documented
approximation; in the co-located layout there is one chunk and nothing is approximated). The
projector goes with backbone stage 0. Images at their own resolution (``MicroBatchShapes.
image_tokens``) count as standard images in proportion to their tokens (``image_units``): exact
for the projector and every per-patch part of the ViT; the ViT's attention within an image grows
with its patches squared, so a large image is charged less attention than it costs (and a small
one more) - a limit, small where the MLPs dominate the ViT.

A trained ViT keeps its activations from each chunk's forward to its backward:
``vit_activation_bytes_per_image`` per image, derived from the encoder's shapes (latency tables
hold no such entry). With ``recompute_encoder`` only each ViT layer's input is kept and the
backward re-runs the chunk's forward first (its time is added to ``encoder_bwd``).

Lookups interpolate linearly between grid points. Below the grid they take the first point (a
call never costs less than the smallest measured one; zero images cost nothing). Above it they
scale the last point by the component's FLOPs growth (quadratic pair count for attention,
linear otherwise) and are counted in ``StageCosts.extrapolated``. Every component is multiplied by
its calibration scale (``LatencyTable.scales``), and each backbone stage call pays the table's
fixed overhead (``LatencyTable.overhead``, zero unless calibrated).

A split backward's input-gradient part ``bwd_input`` is summed like ``bwd``, from each curve's
``bwd_input`` where the table has one (the profiler times it, online calibration refits it:
``pipetune.calibrate.action_fit``), else from ``INPUT_GRAD_SHARE`` of its backward (attention's is
its whole backward either way), plus ``INPUT_GRAD_OVERHEAD`` of the fixed backward overhead; stage
0's is zero unless a trained encoder's images need its input gradient.

Messages: backbone activations ``tokens x dim``, encoder activations between encoder chunks
``images x patches x encoder dim``, image features to backbone stage 0 ``images x tokens per image
x merged dim``, each costing the table's ``p2p`` latency plus bytes over bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipetune.config.model import ModelConfig
from pipetune.cost.latency_table import Curve, LatencyTable
from pipetune.cost.stage_layout import StageLayout
from pipetune.data.samples import SampleTable
from pipetune.packing.flops import attention_pairs
from pipetune.packing.groups import Packing
from pipetune.packing.sub_batches import SubBatches

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# The input-gradient share of each component's backward, what a split backward's ``I`` takes (the
# weight gradient ``W`` takes the rest): attention cores have no weights; a matmul's two
# gradients cost one forward each; the embedding's input (token ids) needs no gradient. A FLOPs
# estimate, used where the table's curve has no ``bwd_input`` (profiled or fitted online);
# attention's ``I`` is its whole backward either way.
INPUT_GRAD_SHARE = {"attention": 1.0, "linear_attention": 1.0, "rest": 0.5, "head": 0.5, "projector": 0.5, "embedding": 0.0}
INPUT_GRAD_OVERHEAD = 0.5  # of a stage backward call's fixed seconds, what a split backward's I pays (W the rest)


def reads_input_grad(name: str, curve: Curve) -> bool:
    """Whether a split backward's ``I`` of component ``name`` is read off its curve's ``bwd_input``
    rather than ``INPUT_GRAD_SHARE`` of its backward: never for attention (no weights: its ``I`` is
    its whole backward)."""
    return curve.bwd_input is not None and name != "attention"


def input_grad_values(name: str, curve: Curve) -> np.ndarray:
    """A split backward's ``I`` of component ``name`` at its curve's grid points, as the cost model
    prices it."""
    return curve.bwd_input if reads_input_grad(name, curve) else INPUT_GRAD_SHARE[name] * curve.bwd


@dataclass(frozen=True)
class MicroBatchShapes:
    """What the cost model needs of ``m`` micro-batches: document lengths, image counts and
    image tokens (None: every image is the model's standard image)."""

    doc_lengths: np.ndarray
    doc_mb: np.ndarray
    tokens: np.ndarray
    images: np.ndarray
    image_tokens: np.ndarray | None = None

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
            image_tokens=np.bincount(doc_mb, weights=table.sample_image_tokens[order], minlength=m).astype(np.int64),
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
        return MicroBatchShapes(self.doc_lengths[keep], new[self.doc_mb[keep]], self.tokens[idx], self.images[idx],
                                None if self.image_tokens is None else self.image_tokens[idx])


@dataclass(frozen=True)
class StageCosts:
    """Seconds and bytes: backbone per micro-batch (rows) and stage (columns); encoder per
    sub-microbatch (``sub_batches``) and encoder chunk. ``p2p``, ``encoder_p2p`` and
    ``feature_p2p`` are one message of each kind (see the module doc; a gradient costs as much).
    ``bwd_input``: the input-gradient part of ``bwd`` (``CostModel.components``); ``weight_grad_bytes``
    what a split backward holds from ``I`` to ``W`` (``CostModel.weight_grad_bytes``); ``copy``: one
    way of a backbone chunk's activations between device and host (None: the table has no host link).
    ``contention``: the table's (see ``pipetune.simulate.contention``)."""

    fwd: np.ndarray
    bwd: np.ndarray
    p2p: np.ndarray
    activation_bytes: np.ndarray
    sub_batches: SubBatches
    encoder: np.ndarray
    encoder_bwd: np.ndarray
    encoder_p2p: np.ndarray
    feature_p2p: np.ndarray
    encoder_activation_bytes: np.ndarray
    image_feature_bytes: np.ndarray
    extrapolated: int
    bwd_input: np.ndarray | None = None
    weight_grad_bytes: np.ndarray | None = None
    contention: float = 0.0
    copy: np.ndarray | None = None


def rank_work(placement, costs) -> np.ndarray:
    """Busy seconds of every rank under ``placement`` for ``costs`` (``StageCosts`` or the
    simulator's ``Latencies``: anything with ``fwd``, ``bwd``, ``encoder`` and ``encoder_bwd``;
    the encoder's backward counts only when it is trained)."""
    work = np.zeros(placement.num_ranks)
    np.add.at(work, np.array(placement.backbone), (costs.fwd + costs.bwd).sum(axis=0))
    if placement.encoder:
        enc = costs.encoder + (costs.encoder_bwd if placement.encoder_trained else 0.0)
        np.add.at(work, np.array(placement.encoder), enc.sum(axis=0))
    return work


def vit_activation_bytes_per_image(model: ModelConfig, tp: int, dtype_bytes: int, *, recompute: bool = False, layers: int | None = None) -> float:
    """Bytes a trained ViT keeps per image for the backward of ``layers`` of its layers (default:
    all; FlashAttention, no softmax matrix): per layer and patch the inputs of its matmuls and
    elementwise ops, ``8 dim + 2 ffn_dim`` values split over ``tp`` ranks; with ``recompute``, each
    layer's input plus one layer's full set."""
    enc = model.encoder
    if enc is None or enc.frozen:
        return 0.0
    layers = enc.n_layers if layers is None else layers
    per_layer = dtype_bytes * enc.patches_per_image * (8 * enc.dim + 2 * enc.ffn_dim) / tp
    if recompute:
        return layers * dtype_bytes * enc.patches_per_image * enc.dim / tp + per_layer
    return layers * per_layer


def _growth(x: np.ndarray, kind: str) -> np.ndarray:
    return attention_pairs(x) if kind == "seq_len" else x.astype(np.float64)


def lookup(curve: Curve, x: np.ndarray, which: str) -> tuple[np.ndarray, int]:
    """Curve value at ``x`` (``which``: fwd, bwd or the curve's bwd_input; see module doc for
    below/above the grid); returns (values, # extrapolated)."""
    x = np.asarray(x, dtype=np.float64)
    vals = getattr(curve, which)
    out = np.interp(x, curve.grid, vals)
    above = x > curve.grid[-1]
    if above.any():
        out[above] = vals[-1] * _growth(x[above], curve.x) / _growth(curve.grid[-1:], curve.x)
    out[x <= 0] = 0.0
    return out, int(above.sum())


class CostModel:
    """Vectorised latency estimates for one model, table and layout (co-located or separated)."""

    def __init__(self, table: LatencyTable, layout: StageLayout, *, recompute_encoder: bool = False):
        model = table.model
        if layout.num_layers != model.backbone.n_layers:
            raise ValueError(f"stage layout covers {layout.num_layers} layers but model {model.name!r} has {model.backbone.n_layers}")
        enc = model.encoder
        if layout.is_separated and (enc is None or layout.encoder_chunks[-1][1] != enc.n_layers):
            raise ValueError(f"the separated layout's encoder chunks {list(layout.encoder_chunks)} do not cover model "
                             f"{model.name!r}'s encoder ({enc.n_layers if enc else 0} layers)")
        self.table = table
        self.layout = layout
        self.layers = np.asarray(layout.layers_per_stage(), dtype=np.float64)
        self.linear_layers = np.asarray(layout.layers_among(model.backbone.linear_layers), dtype=np.float64)
        self.full_layers = self.layers - self.linear_layers
        self.dtype_bytes = DTYPE_BYTES.get(table.dtype, 2)
        self.encoder_trainable = enc is not None and not enc.frozen
        self.beyond_grid: dict[str, float] = {}  # component -> largest size looked up past its grid
        self.recompute_encoder = recompute_encoder and self.encoder_trainable
        self.encoder_bytes_per_image = vit_activation_bytes_per_image(model, table.tp, self.dtype_bytes, recompute=self.recompute_encoder)
        chunk_layers = [hi - lo for lo, hi in layout.encoder_chunks] or ([enc.n_layers] if enc is not None else [1])
        self.encoder_layers = np.asarray(chunk_layers, dtype=np.float64)
        self.encoder_share = self.encoder_layers / self.encoder_layers.sum()
        self.encoder_bytes_per_image_chunk = np.array([vit_activation_bytes_per_image(
            model, table.tp, self.dtype_bytes, recompute=self.recompute_encoder, layers=int(n)) for n in chunk_layers])
        self.weight_copy_bytes, self.projector_copy_bytes, self.encoder_weight_copy_bytes = self._weight_copies()
        self.input_grad_curves = any(reads_input_grad(n, c) for n, c in table.curves.items() if n in INPUT_GRAD_SHARE)

    def _weight_copies(self) -> tuple[np.ndarray, float, np.ndarray]:
        """With master weights (``LatencyTable.master_weights``: float32 weights under autocast, a
        job without FSDP) every forward casts the matmul weights it trains and autograd keeps the
        copies until its backward: bytes per backbone chunk and micro-batch, the projector's (stage
        0, micro-batches with images) and per trained encoder chunk and forward; zero otherwise."""
        model, S, E = self.table.model, len(self.layers), len(self.encoder_layers)
        if not self.table.master_weights:
            return np.zeros(S), 0.0, np.zeros(E)
        b, per = model.backbone, self.dtype_bytes / self.table.tp
        backbone = self.layers * b.layer_params * per
        backbone[-1] += b.vocab_size * b.dim * per
        encoder = np.zeros(E)
        if self.encoder_trainable:
            enc = model.encoder
            encoder = self.encoder_layers * enc.layer_params * per
            encoder[0] += enc.patch_dim * enc.dim * per
        return backbone, model.projector_params * per, encoder

    def with_layout(self, layout: StageLayout) -> "CostModel":
        """The same table and options on another layout."""
        return CostModel(self.table, layout, recompute_encoder=self.recompute_encoder)

    @property
    def num_stages(self) -> int:
        return self.layout.num_stages

    def placement(self):
        """Where this cost model's layout puts the model's chunks."""
        return self.layout.placement(encoder=self.table.model.encoder is not None, encoder_trained=self.encoder_trainable)

    def _curve(self, name: str, x: np.ndarray, which: str) -> tuple[np.ndarray, int]:
        """``which``: fwd, bwd or bwd_input (the curve's where ``reads_input_grad``, else
        ``INPUT_GRAD_SHARE`` of the backward)."""
        if name not in self.table.curves:
            return np.zeros(len(x)), 0
        curve = self.table.curves[name]
        if which == "bwd_input" and not reads_input_grad(name, curve):
            values, n = lookup(curve, x, "bwd")
            return INPUT_GRAD_SHARE[name] * values, n
        values, n = lookup(curve, x, which)
        if n:
            self.beyond_grid[name] = max(self.beyond_grid.get(name, 0.0), float(np.max(x)))
        return values, n

    def per_layer(self, shapes: MicroBatchShapes, which: str) -> tuple[dict[str, np.ndarray], int]:
        """Unscaled seconds per micro-batch of one layer's parts: ``rest`` (every layer),
        ``attention`` (a full-attention layer, summed over documents) and, for a model with linear-attention
        layers, ``linear_attention`` (over the chunk-padded tokens); and how many lookups were
        extrapolated."""
        m = shapes.num_micro_batches
        attn, n1 = self._curve("attention", shapes.doc_lengths, which)
        rest, n2 = self._curve("rest", shapes.tokens, which)
        out = {"attention": np.bincount(shapes.doc_mb, weights=attn, minlength=m), "rest": rest}
        la = self.table.model.backbone.linear_attention
        if la is None:
            return out, n1 + n2
        chunked = np.bincount(shapes.doc_mb, weights=la.chunked(shapes.doc_lengths), minlength=m)
        out["linear_attention"], n3 = self._curve("linear_attention", chunked, which)
        return out, n1 + n2 + n3

    def layer_seconds(self, shapes: MicroBatchShapes) -> np.ndarray:
        """Scaled forward + backward seconds of each backbone layer over all these micro-batches:
        what a stage pays per layer it holds, by the layer's kind."""
        total = {}
        for which in ("fwd", "bwd"):
            parts, _ = self.per_layer(shapes, which)
            for name, v in parts.items():
                total[name] = total.get(name, 0.0) + self.table.scale(name) * float(v.sum())
        linear = np.zeros(self.table.model.backbone.n_layers, dtype=bool)
        linear[list(self.table.model.backbone.linear_layers)] = True
        return total["rest"] + np.where(linear, total.get("linear_attention", 0.0), total["attention"])

    def components(self, shapes: MicroBatchShapes) -> tuple[dict[str, dict[str, np.ndarray]], int]:
        """Unscaled contribution of each backbone-side table component to each (micro-batch, stage)
        latency: ``{component: {"fwd": [m, S], "bwd": [m, S], "bwd_input": [m, S]}}`` (``bwd_input``
        the backward's input-gradient part, see ``_curve``), and how many fwd/bwd lookups were
        extrapolated. The encoder is a module of its own: ``encoder_curve``."""
        m, S = shapes.num_micro_batches, self.num_stages
        out: dict[str, dict[str, np.ndarray]] = {}
        extrapolated = 0
        count = {"rest": self.layers, "attention": self.full_layers, "linear_attention": self.linear_layers}
        for which in ("fwd", "bwd", "bwd_input") if self.input_grad_curves else ("fwd", "bwd"):
            parts, n = self.per_layer(shapes, which)
            extrapolated += n if which != "bwd_input" else 0
            for name, v in parts.items():
                out.setdefault(name, {})[which] = v[:, None] * count[name][None, :]
            for name, stage, x in (
                ("embedding", 0, shapes.tokens),
                ("projector", 0, self.image_units(shapes)),
                ("head", S - 1, shapes.tokens),
            ):
                v, n = self._curve(name, x, which)
                extrapolated += n if which != "bwd_input" else 0
                col = np.zeros((m, S))
                col[:, stage] = v
                out.setdefault(name, {})[which] = col
        if not self.input_grad_curves:  # the shares alone: no third round of lookups
            for name, p in out.items():
                p["bwd_input"] = INPUT_GRAD_SHARE[name] * p["bwd"]
        return out, extrapolated

    def encoder_curve(self, images: np.ndarray, which: str) -> tuple[np.ndarray, int]:
        """Unscaled seconds of the whole encoder over ``images`` images (``which``: fwd or bwd)."""
        return self._curve("encoder", np.asarray(images), which)

    def sub_batches(self, shapes: MicroBatchShapes) -> SubBatches:
        """The encoder's units for these micro-batches under this layout."""
        if self.layout.is_separated:
            return SubBatches.split(shapes.images, self.layout.image_sub_batch)
        return SubBatches.one_per_micro_batch(shapes.images, self.image_units(shapes))

    def image_units(self, shapes: MicroBatchShapes) -> np.ndarray:
        """Images per micro-batch in the model's standard images (image tokens over the standard
        image's): what the encoder, projector and image message entries are counted in."""
        tpi = self.table.model.tokens_per_image
        if shapes.image_tokens is None or tpi == 0:
            return shapes.images
        return shapes.image_tokens / tpi

    def activation_bytes(self, shapes: MicroBatchShapes) -> np.ndarray:
        """Saved activation bytes per (micro-batch, stage), weight copies included (``_weight_copies``);
        no latency lookups (memory probes use it)."""
        mem = self.table.memory
        act = shapes.tokens[:, None] * (self.layers[None, :] * mem["layer_bytes_per_token"])
        act[:, 0] += shapes.tokens * mem["embedding_bytes_per_token"] + self.image_units(shapes) * mem["projector_bytes_per_image"]
        act[:, -1] += shapes.tokens * mem["head_bytes_per_token"]
        act += self.weight_copy_bytes[None, :]
        act[:, 0] += (shapes.images > 0) * self.projector_copy_bytes
        return act

    def weight_grad_bytes(self, shapes: MicroBatchShapes) -> np.ndarray:
        """Bytes per (micro-batch, stage) that a split backward holds from ``I`` to ``W``: the
        gradient of every weight operation's output, which its weight gradient multiplies (per
        token: q, k, v, o (and the output gate), the FFN's three projections, both norms; the
        head and final norm on the last stage; the embedding, and per image token the projector's
        layers, on the first). Linear-attention layers are counted as full-attention ones."""
        model = self.table.model
        b, enc = model.backbone, model.encoder
        kv = 2 * b.n_kv_heads * (b.dim // b.n_heads)
        per_layer = (b.dim * (5 + b.output_gate) + kv + 2 * b.ffn_dim) * self.dtype_bytes / self.table.tp
        out = shapes.tokens[:, None] * (self.layers[None, :] * per_layer)
        out[:, -1] += shapes.tokens * (b.vocab_size + b.dim) * self.dtype_bytes / self.table.tp
        out[:, 0] += shapes.tokens * b.dim * self.dtype_bytes / self.table.tp
        if enc is not None:
            widths = sum(enc.projector_hidden or (b.dim,)) + b.dim
            out[:, 0] += self.image_units(shapes) * model.tokens_per_image * widths * self.dtype_bytes / self.table.tp
        return out

    def input_grad_idle(self, shapes: MicroBatchShapes) -> np.ndarray:
        """Per micro-batch, whether stage 0's ``I`` has nothing to do: its input needs a gradient
        only for a trained encoder's images; elsewhere ``W`` runs the whole backward (torch's
        first-stage rule)."""
        return ~(self.encoder_trainable & (shapes.images > 0))

    def _message(self, nbytes: np.ndarray) -> np.ndarray:
        return self.table.p2p["latency_s"] + nbytes / self.table.p2p["bytes_per_s"]

    def stage_costs(self, shapes: MicroBatchShapes) -> StageCosts:
        m, S = shapes.num_micro_batches, self.num_stages
        parts, extrapolated = self.components(shapes)
        fwd = np.zeros((m, S))
        bwd = np.zeros((m, S))
        fwd += self.table.fixed("fwd")
        bwd += self.table.fixed("bwd")
        bwd_input = bwd * INPUT_GRAD_OVERHEAD
        for name, p in parts.items():
            fwd += self.table.scale(name) * p["fwd"]
            bwd += self.table.scale(name) * p["bwd"]
            bwd_input += self.table.scale(name) * p["bwd_input"]
        model, mem = self.table.model, self.table.memory
        sub = self.sub_batches(shapes)
        images = sub.charged
        E = len(self.encoder_share)
        scale = self.table.scale("encoder")
        whole_f, n1 = self.encoder_curve(images, "fwd")
        whole_b, n2 = self.encoder_curve(images, "bwd")
        encoder = scale * whole_f[:, None] * self.encoder_share[None, :]
        encoder_bwd = np.zeros((sub.count, E))
        if self.encoder_trainable:
            encoder_bwd = scale * whole_b[:, None] * self.encoder_share[None, :] + (encoder if self.recompute_encoder else 0.0)
        enc = model.encoder
        multi = self.placement().num_ranks > 1
        encoder_p2p = feature_p2p = np.zeros(sub.count)
        if enc is not None and multi:
            encoder_p2p = self._message(images * enc.patches_per_image * enc.dim * self.dtype_bytes)
            feature_p2p = self._message(images * enc.tokens_per_image * enc.merged_dim * self.dtype_bytes)
        weight_grad = self.weight_grad_bytes(shapes)
        activation_bytes = self.activation_bytes(shapes)
        idle = self.input_grad_idle(shapes)
        bwd_input[idle, 0] = 0.0
        weight_grad[idle, 0] = 0.0
        return StageCosts(
            fwd=fwd,
            bwd=bwd,
            bwd_input=bwd_input,
            weight_grad_bytes=weight_grad,
            p2p=self._message(shapes.tokens * model.backbone.dim * self.dtype_bytes) if S > 1 else np.zeros(m),
            activation_bytes=activation_bytes,
            sub_batches=sub,
            encoder=encoder,
            encoder_bwd=encoder_bwd,
            encoder_p2p=encoder_p2p,
            feature_p2p=feature_p2p,
            encoder_activation_bytes=images[:, None] * self.encoder_bytes_per_image_chunk[None, :]
            + (images > 0)[:, None] * self.encoder_weight_copy_bytes[None, :],
            image_feature_bytes=images * mem["image_feature_bytes"],
            extrapolated=extrapolated + n1 + n2,
            contention=self.table.contention,
            copy=self.copy_seconds(activation_bytes),
        )

    def copy_seconds(self, nbytes: np.ndarray) -> np.ndarray | None:
        """One copy of ``nbytes`` between device and pinned host memory (activation offload), or
        None when the table has no host link (profiled tables without it: no offload)."""
        host = self.table.host
        return None if host is None else host["latency_s"] + np.asarray(nbytes, np.float64) / host["bytes_per_s"]
