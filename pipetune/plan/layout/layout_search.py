"""Job-level stage layout search: how many backbone layers each pipeline stage holds.

The even split ignores that stage 0 also runs the embeddings, the projector and the vision encoder
(a trained 5B ViT costs as much as several backbone layers) and the last stage the output head, so
stage 0 gates the pipeline. The search, before training, on a sample of the job's batches:

1. packs each sampled batch once per micro-batch size (balanced packing balances FLOPs, so it does
   not depend on the layout);
2. starts from the layout that balances each stage's expected busy time (its fixed work plus the
   expected work of the layers it holds, a full-attention layer priced apart from a
   linear-attention one; ``StageLayout.balanced``), or from the even split if that scores better;
3. moves one layer between neighbouring stages while the expected iteration time improves.

With virtual stages (``chunks_per_rank`` V >= 2 in the cost model's layout) the same search runs
over the ``V x P`` backbone chunks: the balanced start balances every chunk (so every rank, and
the rate at which rank 0, beside the encoder, feeds the pipeline), and a move shifts one layer
across one chunk boundary. With ``split_backward`` the scores are the planner's with that choice
of zero-bubble tables, as the job will run. The separated layout has one chunk per rank and
whole backwards, so ``search(separated=True)`` refuses either.

A layout's score is the mean over sampled batches of the iteration time the per-iteration planner
(``pipetune`` mode) predicts under that layout: every candidate it considers has its simulated peak
memory, plus that layout's model states, checked against the budget on every stage, and a layout on
which some sampled batch has no plan that fits scores ``inf``.
Torch's pipelining has no layout search (``split_backbone`` takes explicit ranges); hence this.

``compare_layouts`` puts the co-located layouts (even and searched backbone split) against the
separated layout (DIP), in simulation: the same iterations planned in ``pipetune`` mode on each, so
the figures differ only by layout (and by the schedules each layout's planner can build).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from pipetune.data.images import ImageSizing
from pipetune.config.model import ModelConfig
from pipetune.cost.cost_model import CostModel, MicroBatchShapes, rank_work
from pipetune.cost.memory import max_micro_batch_size
from pipetune.cost.stage_layout import StageLayout
from pipetune.data.batch import BatchMeta, batch_meta
from pipetune.data.samples import SampleTable
from pipetune.data.stream import BatchStream
from pipetune.packing.config import PackerKind, PackingConfig
from pipetune.plan.layout.compare import ModeSummary, compare_modes
from pipetune.plan.mode import Mode
from pipetune.plan.separated.partitioner import Partition, partition
from pipetune.plan.layout.planner_config import PlannerConfig, SplitBackward, separated_excluded
from pipetune.schedule.schedules import Schedule
from pipetune.schedule.table import Placement


@dataclass(frozen=True)
class LayoutScore:
    """Expected iteration time of one layout over the sample (``inf`` when nothing fits memory),
    each stage's mean busy fraction and its largest peak bytes (model states included)."""

    layout: StageLayout
    iter_s: float
    busy: np.ndarray
    peak_bytes: np.ndarray


@dataclass(frozen=True)
class LayoutSearchResult:
    """``best``: the layout ``auto`` picks; ``split``: the best co-located backbone split (the
    same as ``best`` unless the separated layout, when scored, predicts faster); ``separated``: the
    partitioner's separated layout, when scored."""

    best: LayoutScore
    even: LayoutScore
    split: LayoutScore
    separated: LayoutScore | None
    evaluated: int
    search_s: float

    @property
    def cut_vs_even(self) -> float:
        return 1 - self.best.iter_s / self.even.iter_s


class LayoutSearch:
    """Scores layouts for one model, cost model and sample of batches (see module doc)."""

    def __init__(
        self,
        model: ModelConfig,
        cost: CostModel,
        sample: list[BatchMeta],
        *,
        max_seq_len: int,
        memory_bytes: float,
        reserve: float = 0.1,
        schedule: Schedule = Schedule.ONE_F_ONE_B,
        split_backward: SplitBackward = SplitBackward.OFF,
        max_mbs: int = 64,
        seed: int = 0,
        offload: bool = False,
    ):
        if not sample:
            raise ValueError("layout search needs at least one sampled batch")
        self.cost = cost
        self.budget = memory_bytes * (1 - reserve)
        self.n_layers = model.backbone.n_layers
        self.num_stages = cost.num_stages
        self.chunks_per_rank = cost.layout.chunks_per_rank
        self.sample = sample
        self.model = model
        self.planner_config = PlannerConfig(
            mode=Mode.PIPETUNE, max_seq_len=max_seq_len, memory_bytes=memory_bytes, reserve=reserve, schedule=schedule,
            split_backward=split_backward, max_mbs=max_mbs, seed=seed, offload=offload
        )
        self.style = cost.layout.style
        self.even = StageLayout.even(self.n_layers, self.num_stages, chunks_per_rank=self.chunks_per_rank, style=self.style)
        even = cost.with_layout(self.even)
        self.top_mbs = max(max_micro_batch_size(even, max_seq_len, memory_bytes, reserve=reserve, limit=max_mbs), 1)
        self._shapes: dict[tuple[int, int], MicroBatchShapes] = {}
        self._scores: dict[StageLayout, LayoutScore] = {}
        self._partition: Partition | None = None

    def sized(self, sizes) -> StageLayout:
        """The co-located layout with these layers per backbone chunk, at the search's chunks per rank."""
        return StageLayout.from_sizes(sizes, chunks_per_rank=self.chunks_per_rank, style=self.style)

    def shapes(self, b: int, mbs: int) -> MicroBatchShapes:
        """Sampled batch ``b`` balance-packed at ``mbs`` (as the planner packs it)."""
        if (b, mbs) not in self._shapes:
            cfg = self.planner_config
            self._shapes[b, mbs] = balanced_shapes(self.model, self.sample[b], mbs, max_seq_len=cfg.max_seq_len, seed=cfg.seed)
        return self._shapes[b, mbs]

    def score(self, layout: StageLayout) -> LayoutScore:
        key = layout
        if key in self._scores:
            return self._scores[key]
        cost = self.cost.with_layout(layout)
        S = self.num_stages
        spans, busy, peaks = [], [], []
        try:
            planner = self.planner_config.build(self.model, cost)
            for b, meta in enumerate(self.sample):
                plan = planner.plan(meta)
                work = rank_work(cost.placement(), cost.stage_costs(self.shapes(b, plan.mbs)))
                spans.append(plan.predicted_s)
                busy.append(work / plan.predicted_s)
                peaks.append(plan.peak_bytes)
        except ValueError:  # no micro-batch size fits memory under this layout
            spans, busy, peaks = [np.inf], [np.zeros(S)], [np.full(S, np.inf)]
        s = LayoutScore(layout, float(np.mean(spans)), np.mean(busy, axis=0), np.max(peaks, axis=0))
        self._scores[key] = s
        return s

    def balanced_start(self) -> StageLayout:
        """The split that balances each chunk's expected work, its fixed work plus that of the
        layers it holds, each priced by its kind (module doc, 2); the encoder counts on chunk 0,
        beside which it runs."""
        even = self.even
        cost = self.cost.with_layout(even)
        per_chunk = Placement.colocated(self.num_stages, encoder=self.model.encoder is not None,
                                        encoder_trained=cost.encoder_trainable)  # one chunk per "rank": each chunk's own work
        work = np.zeros(self.num_stages)
        layer_s = np.zeros(self.n_layers)
        for b in range(len(self.sample)):
            shapes = self.shapes(b, self.top_mbs)
            work += rank_work(per_chunk, cost.stage_costs(shapes))
            layer_s += cost.layer_seconds(shapes)
        fixed = work - np.array([layer_s[lo:hi].sum() for lo, hi in even.layer_ranges])
        return self.sized(StageLayout.balanced(fixed, layer_s).layers_per_stage())

    def neighbours(self, layout: StageLayout) -> list[StageLayout]:
        """Every layout one layer away: one layer moved across one chunk boundary."""
        sizes = np.array(layout.layers_per_stage())
        out = []
        for s in range(self.num_stages - 1):
            for src, dst in ((s, s + 1), (s + 1, s)):
                if sizes[src] > 1:
                    n = sizes.copy()
                    n[src] -= 1
                    n[dst] += 1
                    out.append(self.sized(n))
        return out

    def search(self, *, max_moves: int | None = None, separated: bool = False) -> LayoutSearchResult:
        """The best co-located split (module doc); with ``separated`` (a model with an encoder, one
        chunk per rank, whole backwards), also the partitioner's separated layout
        (``pipetune.plan.separated.partitioner``), and the faster of the two."""
        cfg = self.planner_config
        excluded = separated_excluded(chunks_per_rank=self.chunks_per_rank, split_backward=cfg.split_backward,
                                      jitter_draws=cfg.jitter_draws, offload=cfg.offload) if separated else []
        if excluded:
            raise ValueError(f"the separated layout does not run {' and '.join(excluded)}: search the co-located split only")
        t0 = time.perf_counter()
        even = self.score(self.even)
        split = min((self.score(self.balanced_start()), even), key=lambda s: s.iter_s)
        for _ in range(max_moves if max_moves is not None else self.n_layers):
            cand = min((self.score(n) for n in self.neighbours(split.layout)), key=lambda s: s.iter_s, default=split)
            if not cand.iter_s < split.iter_s:
                break
            split = cand
        sep = self.score(self.partition().layout) if separated and self.model.encoder is not None else None
        best = min((s for s in (split, sep) if s is not None), key=lambda s: s.iter_s)
        if not np.isfinite(best.iter_s):
            raise ValueError(
                f"no stage layout fits the sampled batches in {self.budget / 2**30:.1f} GiB per GPU at any micro-batch size; "
                "lower --max-seq-len, recompute the encoder (--recompute-encoder) or add memory"
            )
        return LayoutSearchResult(best, even, split, sep, len(self._scores), time.perf_counter() - t0)

    def partition(self) -> Partition:
        """The partitioner's separated layout for the sampled batches (balance-packed at micro-batch size 1)."""
        if self._partition is None:
            shapes = [self.shapes(b, 1) for b in range(len(self.sample))]
            self._partition = partition(self.model, self.cost, shapes, max_seq_len=self.planner_config.max_seq_len)
        return self._partition


def balanced_shapes(model: ModelConfig, meta: BatchMeta, mbs: int, *, max_seq_len: int, seed: int) -> MicroBatchShapes:
    """``meta``'s batch balance-packed at ``mbs``, as the planner packs it."""
    packing = PackingConfig(packer=PackerKind.BALANCED, mbs=mbs, max_seq_len=max_seq_len, seed=seed).build(model)(meta.table.lengths, meta.step)
    return MicroBatchShapes.from_packing(meta.table, packing)


def sample_batches(data, model: ModelConfig, *, gbs: int, max_seq_len: int, count: int, seed: int, overlong="truncate") -> list[BatchMeta]:
    """``count`` batches of the job's data drawn with their own shuffle seed, so the layout is not
    fitted to the very iterations it is then evaluated on."""
    stream = BatchStream(num_rows=len(data), gbs=gbs, seed=seed + 7919)
    return [
        batch_meta(data, stream, step, images=ImageSizing.for_model(model), max_seq_len=max_seq_len, overlong=overlong)
        for step in range(count)
    ]


@dataclass(frozen=True)
class LayoutRun:
    """One layout's planned iterations, or why none could be planned (``error``)."""

    name: str
    layout: StageLayout
    summary: ModeSummary | None
    error: str = ""


def compare_layouts(model: ModelConfig, cost: CostModel, data: SampleTable, *, gbs: int, max_seq_len: int, memory_bytes: float,
                    iters: int, sample: int = 8, seed: int = 0, overlong="truncate") -> tuple[list[LayoutRun], Partition]:
    """``even``, ``split`` (the layout search's best co-located split) and ``separated`` (the
    partitioner), each planned on the same ``iters`` batches; a layout on which no plan fits memory
    is reported with its error. ``--layout auto`` picks the faster of ``split`` and ``separated``
    on the sampled batches (``LayoutSearch.search(separated=True)``)."""
    even = cost.with_layout(StageLayout.even(model.backbone.n_layers, cost.num_stages))
    metas = sample_batches(data, model, gbs=gbs, max_seq_len=max_seq_len, count=sample, seed=seed, overlong=overlong)
    search = LayoutSearch(model, even, metas, max_seq_len=max_seq_len, memory_bytes=memory_bytes, seed=seed)
    layouts = {"even": (even.layout, "")}
    try:
        layouts["split"] = (search.search().split.layout, "")
    except ValueError as e:  # no co-located split fits memory
        layouts["split"] = (even.layout, str(e))
    part = search.partition()
    layouts["separated"] = (part.layout, "")
    runs = []
    for name, (layout, error) in layouts.items():
        if error:
            runs.append(LayoutRun(name, layout, None, error))
            continue
        try:
            summary = compare_modes(model, cost.with_layout(layout), data, gbs=gbs, max_seq_len=max_seq_len, memory_bytes=memory_bytes,
                                    iters=iters, overlong=overlong, seed=seed, modes=(Mode.PIPETUNE,), best_static=False)["pipetune"]
            runs.append(LayoutRun(name, layout, summary))
        except ValueError as e:
            runs.append(LayoutRun(name, layout, None, str(e)))
    return runs, part
