"""Planning off the training critical path: plan batch t+1.. while batch t trains.

``AsyncPlanner`` is a packing source for ``PipeTuneDataLoader``: when the loader asks for step
``t``'s packing it also queues steps ``t+1 .. t+lookahead`` (their metadata is known ahead, see
``pipetune.data.stream``), and a background thread plans them in step order. Each search gets a
deadline of ``budget_s`` after it was queued; a search that passes it returns the balanced plan at
the last good micro-batch size (logged, and marked ``fallback``). The training loop reads the plan
of the step it is running with ``pop(step)``.

A thread, not a process: the search is numpy and the training step is torch, both of which release
the GIL in their heavy parts, and a thread shares the planner's caches without pickling.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable

from pipetune.data.batch import BatchMeta
from pipetune.plan.plan import IterationPlan, PlanError
from pipetune.plan.planner import Planner

if TYPE_CHECKING:
    from pipetune.plan.replicas import ReplicaPlanner


class AsyncPlanner:
    def __init__(self, planner: Planner | ReplicaPlanner, meta_fn: Callable[[int], BatchMeta], *, budget_s: float | None = None, lookahead: int = 2):
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {lookahead}")
        self.planner = planner
        self.meta_fn = meta_fn
        self.budget_s = budget_s
        self.lookahead = lookahead
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipetune-planner")
        self._futures: dict[int, Future] = {}
        self._plans: dict[int, IterationPlan] = {}
        self._consumed_mbs = planner.last_mbs
        self._lock = threading.Lock()

    def _submit(self, step: int, meta: BatchMeta | None = None) -> Future:
        with self._lock:
            if step not in self._futures:
                queued = time.perf_counter()
                deadline = None if self.budget_s is None else queued + self.budget_s

                def work():
                    return self.planner.plan(meta if meta is not None else self.meta_fn(step), deadline=deadline)

                self._futures[step] = self._pool.submit(work)
            return self._futures[step]

    def _ready(self, meta: BatchMeta):
        """``meta``'s plan (blocks until it or its fallback is ready), queueing the next steps'."""
        future = self._submit(meta.step, meta)
        for ahead in range(1, self.lookahead + 1):
            self._submit(meta.step + ahead)
        plan = future.result().validate(meta.table.ids)
        with self._lock:
            self._futures.pop(meta.step, None)
            self._plans[meta.step] = plan
        return plan

    def __call__(self, meta: BatchMeta) -> list[list[int]]:
        """The packing of ``meta``'s step (as a loader's packing source)."""
        return [list(mb) for mb in self._ready(meta).micro_batches]

    def plan(self, meta: BatchMeta):
        """``meta``'s plan, taken at once (for a caller that is both loader and training loop); of
        the wrapped planner's type (an ``IterationPlan``, or a ``ReplicaPlanner``'s plans)."""
        self._ready(meta)
        return self.pop(meta.step)

    def pop(self, step: int):
        """The plan the loader used for ``step`` (each plan is handed out once)."""
        with self._lock:
            if step not in self._plans:
                raise PlanError(f"no plan for step {step}: the loader has not produced that batch yet")
            plan = self._plans.pop(step)
            self._consumed_mbs = plan.mbs
            return plan

    def state_dict(self) -> dict:
        """The fallback's micro-batch size as of the last plan the training loop took (``pop``)."""
        return {"last_mbs": self._consumed_mbs}

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            for f in self._futures.values():
                f.cancel()
            self._futures.clear()
            self._plans.clear()
            self._consumed_mbs = self.planner.last_mbs = int(state["last_mbs"])

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
