"""The planner's settings, and ``PlannerConfig.build``, which picks the planner for a cost model's
layout. Kept apart from both planners so that ``pipetune.plan.separated.separated_planner`` can subclass ``Planner``
without ``pipetune.plan.search.planner`` importing it back."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pipetune.config.model import ModelConfig
from pipetune.cost.cost_model import CostModel
from pipetune.plan.mode import Mode
from pipetune.plan.search.planner import Planner
from pipetune.plan.separated.separated_planner import SeparatedPlanner
from pipetune.schedule.schedules import Schedule


class SplitBackward(StrEnum):
    """Whether plans split every backbone backward into input- and weight-gradient actions
    (zero-bubble tables, ``pipetune.schedule.schedules.list_scheduled``): never, always, or
    ``auto``: per iteration, whichever simulates faster within memory."""

    OFF = "off"
    ON = "on"
    AUTO = "auto"

    @property
    def families(self) -> tuple[bool, ...]:
        """The ``split_backward`` values the planner tries."""
        return {SplitBackward.OFF: (False,), SplitBackward.ON: (True,), SplitBackward.AUTO: (False, True)}[self]


def check_jitter_draws(draws: int, name: str = "jitter_draws") -> None:
    if draws == 1 or draws < 0:
        raise ValueError(f"{name} must be 0 (deterministic) or >= 2, got {draws}")


def separated_excluded(*, encoder: bool = True, chunks_per_rank: int = 1, split_backward: SplitBackward | str = SplitBackward.OFF,
                       jitter_draws: int = 0, offload: bool = False) -> list[str]:
    """What keeps a job off DIP's separated layout (empty: it may run it): the layout needs a vision
    encoder, and its planner runs one chunk per rank with whole backwards, scores deterministic
    times and keeps activations on the device. The one rule behind ``auto`` (command line and
    trainer) and every refusal of ``separated``."""
    return [why for why, applies in (
        ("a model without a vision encoder", not encoder),
        (f"{chunks_per_rank} chunks per rank", chunks_per_rank > 1),
        ("split backward", SplitBackward(split_backward) is not SplitBackward.OFF),
        ("jitter_draws (the separated layout's planner scores deterministic times only)", bool(jitter_draws)),
        ("activation offload", offload),
    ) if applies]


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    """Search settings. ``memory_bytes`` is one GPU's memory (``reserve`` of it is kept free);
    ``mbs`` fixes the micro-batch size of the fixed-size modes (default: the largest that fits).
    ``max_clusters`` bounds the clusters whose permutations are tried (the paper stays below six);
    ``top_sizes`` micro-batch sizes (best packing-order makespan first) get the order search, and
    their ``top_orders`` best orders get encoder placements (``precompute``: frozen encoders, one
    chunk per rank; interleaved plans gain nothing from it, see the planner). ``jitter_draws`` (0
    or >= 2): draws of per-action noise that candidates are scored over (expected makespan), when
    the cost model's table has a variability model; 0 scores the deterministic makespan. ``split_backward``: see
    ``SplitBackward`` (co-located 1F1B layouts only; the stage layout's ``chunks_per_rank`` sets
    virtual stages). ``min_micro_batches``: pack every batch into at least that many micro-batches
    (the balanced packer's ``PackingConfig.min_micro_batches``; a fixed choice for the fixed-size
    modes, a floor for ``pipetune``, which also tries its own counts). ``offload``: where a table
    does not fit memory, offload activations to host memory until it does
    (``pipetune.plan.search.offload_choice``); sizes are then tried up to what fits with two
    micro-batches' activations per rank. Needs a latency table with a host link (``LatencyTable.host``).
    """

    mode: Mode = Mode.PIPETUNE
    max_seq_len: int
    memory_bytes: float
    reserve: float = 0.1
    mbs: int | None = None
    max_mbs: int = 64
    schedule: Schedule = Schedule.ONE_F_ONE_B
    max_clusters: int = 5
    top_sizes: int = 3
    top_orders: int = 3
    precompute: bool = True
    seed: int = 0
    jitter_draws: int = 0
    split_backward: SplitBackward = SplitBackward.OFF
    min_micro_batches: int = 1
    offload: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode(self.mode))
        if self.split_backward not in set(SplitBackward):
            raise ValueError(f"unknown split_backward {self.split_backward!r}; known: {[s.value for s in SplitBackward]}")
        object.__setattr__(self, "split_backward", SplitBackward(self.split_backward))
        if self.schedule not in set(Schedule):
            raise ValueError(f"unknown schedule {self.schedule!r}; known: {[s.value for s in Schedule]}")
        object.__setattr__(self, "schedule", Schedule(self.schedule))
        if self.split_backward is not SplitBackward.OFF and self.schedule is not Schedule.ONE_F_ONE_B:
            raise ValueError(f"split_backward={self.split_backward.value} needs the 1f1b schedule, not {self.schedule.value}")
        if self.mbs is not None and self.mbs < 1:
            raise ValueError(f"mbs must be >= 1 (or None for the largest that fits), got {self.mbs}")
        if not 1 <= self.max_clusters <= 6:
            raise ValueError(f"max_clusters must be in 1..6 (6! = 720 orders), got {self.max_clusters}")
        if self.min_micro_batches < 1:
            raise ValueError(f"min_micro_batches must be >= 1, got {self.min_micro_batches}")
        if self.min_micro_batches > 1 and self.mode is Mode.ORIGINAL:
            raise ValueError(f"min_micro_batches={self.min_micro_batches} needs the balanced packer: mode original packs first-fit")
        check_jitter_draws(self.jitter_draws)

    def build(self, model: ModelConfig, cost: CostModel) -> Planner:
        """The planner for ``cost``'s layout: co-located (``Planner``) or separated (``SeparatedPlanner``)."""
        if self.offload and cost.table.host is None:
            raise ValueError("offload needs the latency table's host link (host.bytes_per_s): profile the table on the GPU or "
                             "build it from a hardware preset, or turn offload off")
        if cost.layout.is_separated:
            excluded = separated_excluded(encoder=model.encoder is not None, split_backward=self.split_backward, jitter_draws=self.jitter_draws,
                                          offload=self.offload)
            if excluded:
                raise ValueError(f"the separated layout does not run {' and '.join(excluded)}: plan a co-located layout, or without them")
            return SeparatedPlanner(self, model, cost)
        return Planner(self, model, cost)
