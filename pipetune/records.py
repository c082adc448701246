"""The per-run record a ``PipeTuneTrainer`` job writes to ``<dump_folder>/pipetune/steps.jsonl``.

One typed record per executed plan, written by the trainer and read back by replays, the
benchmarks and the online calibration's re-analyses, so all of them agree on one schema.
Fields learnt by a replica's lead rank (``kind``, the guard's and the calibration's) are ``None``
until it learns; rank 0 writes every replica's records.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import ClassVar, TypeVar

from pipetune.schedule.table import Action
from pipetune.simulate.simulator import TimedAction

R = TypeVar("R", bound="StepRecord")


class StepKind(str, Enum):
    """Why a step ran its plan (``pipetune.serve.plan_source``)."""

    TUNED = "tuned"
    BASELINE = "baseline"
    CALIBRATION = "calibration"
    REPLAY = "replay"


@dataclass(kw_only=True)
class StepRecord:
    """One run of a plan: what ran, what it was predicted and measured to take, and what rank 0
    learnt from it. ``step`` is the trainer's step (from 1), ``batch`` the data stream's batch
    index; ``timeline`` holds every rank's actions as ``[rank, action, start, end, precomputed]``
    with times relative to the run's first action. ``cold``: the process's first run at this
    micro-batch size (it meets the size's tensor shapes first, so calibration leaves it out).
    ``extra_run``: a run beside the step's own plan (a measurement run of an extension such as the
    CPU testbed's twins); replays and per-step statistics skip it. ``replica``: the data-parallel
    replica whose run this is (a step of ``D`` replicas writes ``D`` records; ``measured_s`` is the
    replica's time, the step's is their maximum). ``peak_bytes``: per pipeline stage of the
    replica, the device memory its rank's allocator peaked at during the run (GPU only; None on
    CPU), beside the plan's simulated peak ``predicted_peak_bytes`` (model states plus in-flight
    activations, as the planner checks it against ``pipetune.memory_gib``). ``host_syncs``: per
    stage, the host-device synchronisations of its rank's action loop (``pipetune.count_host_syncs``;
    None where not counted). ``fallback_reason``: why the replica ran its planner's fallback plan
    (the search passed its budget, the planner process died or stopped answering); empty when it
    did not. ``model_flops``, ``real_tokens``, ``padding_tokens``: what the replica's share trains
    (``pipetune.packing.flops``: the encoder's included, padding not)."""

    step: int
    batch: int
    mode: str
    mbs: int
    micro_batches: int
    order: list[int]
    samples: list[list[int]]
    precomputed_encoders: int
    predicted_s: float
    measured_s: float
    plan_setup_s: float
    loss: float
    fallback: bool
    layout: list[int]
    separated: bool
    plan: str
    timeline: list[list] = field(default_factory=list)
    cold: bool = False
    extra_run: bool = False
    replica: int = 0
    kind: StepKind | None = None
    tuned_predicted_s: float | None = None
    baseline_predicted_s: float | None = None
    guard: str | None = None
    guard_advantage: float | None = None
    contention: float | None = None
    call_overhead_s: float | None = None
    peak_bytes: list[float | None] = field(default_factory=list)
    predicted_peak_bytes: list[float] = field(default_factory=list)
    host_syncs: list[int | None] = field(default_factory=list)
    fallback_reason: str = ""
    model_flops: float = 0.0
    real_tokens: int = 0
    padding_tokens: int = 0

    ENUMS: ClassVar[dict[str, type[Enum]]] = {"kind": StepKind}

    def timed_actions(self) -> list[TimedAction]:
        return [TimedAction(r, Action.parse(a), s, e, p) for r, a, s, e, p in self.timeline]

    def to_json(self) -> str:
        return json.dumps({k: v.value if isinstance(v, Enum) else v for k, v in dataclasses.asdict(self).items()})

    @classmethod
    def from_dict(cls: type[R], d: dict, *, where: str = "record") -> R:
        """A record from its JSON object; keys of other record types (extensions' fields) are
        ignored, a missing field is an error naming ``where``."""
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        try:
            for k, enum in cls.ENUMS.items():
                if kw.get(k) is not None:
                    kw[k] = enum(kw[k])
            return cls(**kw)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: not a pipetune step record ({e})") from None

    @classmethod
    def read(cls: type[R], path: str | Path) -> list[R]:
        """Every record of a ``steps.jsonl``; errors name the file and line."""
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"cannot read {path}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise ValueError(f"{path} is not a text file of pipetune step records") from None
        out = []
        for k, line in enumerate(lines, 1):
            try:
                d = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}, line {k}: not a pipetune step record ({e})") from None
            if not isinstance(d, dict):
                raise ValueError(f"{path}, line {k}: not a pipetune step record (a JSON object expected)")
            out.append(cls.from_dict(d, where=f"{path}, line {k}"))
        return out

    def append_to(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(self.to_json() + "\n")
