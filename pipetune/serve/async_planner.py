"""Planning off the training critical path: plan batch t+1.. while batch t trains.

``AsyncPlanner`` is a packing source for ``PipeTuneDataLoader``: when the loader asks for step
``t``'s packing it also queues steps ``t+1 .. t+lookahead`` (their metadata is known ahead, see
``pipetune.data.stream``), and a planner process plans them in step order. The process reads each
batch's metadata itself (``meta_fn``, sent to it once with the planner), so a request is a step
number and the training process never reads a batch only the planner needs (under data
parallelism, the global batch a replica's lead splits). Each search gets a
deadline of ``budget_s`` after it was queued; a search that passes it returns the balanced plan at
the last good micro-batch size (logged, and marked ``fallback``). The training loop reads the plan
of the step it is running with ``pop(step)``.

A process, not a thread: rank 0 is the busiest rank (stage 0 and the vision encoder), and a
planning thread's numpy search, many small calls, holds the GIL between them and delays the
kernel launches of rank 0's training thread. The process runs ``python -m
pipetune.serve.plan_worker``, which imports the planning core only: multiprocessing's spawn and
forkserver would re-import the trainer's ``__main__`` (``torchtitan.train``, so torch), and fork is
unsafe in a process with threads (torch's).

Pickles travel over the process's stdin and stdout: the planner and ``meta_fn`` once, then one request at a time
(the next is sent when the previous plan arrives; a reader thread receives them into futures).
``set_cost``, ``set_correction`` and ``load_state_dict`` apply to the local planner at once (which
checks them) and travel with the next request, so they apply from the next search on, as on a
shared planner: plans already made, or under way, keep the model they were made with. A request
carries the rest of its budget, so the two processes need no common clock. Every wait is bounded
(budget plus ``grace_s``): a search that raised is re-raised here with its message and the
process's traceback; a process that died, or does not answer, fails the plan with a ``PlanError``
naming what happened.
"""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from pipetune.data.batch import BatchMeta
from pipetune.serve import plan_worker
from pipetune.plan.plan import IterationPlan, PlanError
from pipetune.plan.search.planner import Planner

if TYPE_CHECKING:
    from pipetune.plan.data_parallel.replicas import SharePlanner

REAP_S = 10.0  # to collect a process that ended or was killed


class _Pickler(pickle.Pickler):
    """Pickles a planner: its lock (held only while it plans) arrives as a new one."""

    dispatch_table = copyreg.dispatch_table | {type(threading.Lock()): lambda lock: (threading.Lock, ())}


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def _set_last_mbs(planner, mbs: int) -> None:
    """The fallback's micro-batch size (an attribute; a ``SharePlanner``'s property)."""
    planner.last_mbs = mbs


def _stop(proc: subprocess.Popen, owner: int) -> None:
    """Kill the planner process (it holds nothing worth a clean exit); never from a forked copy of
    its parent, such as a dataloader worker."""
    if os.getpid() == owner:
        proc.kill()
        proc.wait(timeout=REAP_S)
        try:
            proc.stdin.close()
        except OSError:
            pass


def _exit_status(proc: subprocess.Popen) -> str:
    try:
        code = proc.wait(timeout=REAP_S)
    except subprocess.TimeoutExpired:  # alive but its answers broke: stop it
        proc.kill()
        code = proc.wait(timeout=REAP_S)
    return f"exited with code {code}" + (f" ({signal.strsignal(-code)})" if code < 0 else "")


@dataclass(eq=False)
class _Request:
    step: int | None  # None: the planner's arrival
    deadline: float | None  # this process's perf_counter
    wait_until: float
    future: Future = field(default_factory=Future)

    @property
    def doing(self) -> str:
        return "starting" if self.step is None else f"planning step {self.step}"


class AsyncPlanner:
    def __init__(self, planner: Planner | SharePlanner, meta_fn: Callable[[int], BatchMeta], *, budget_s: float | None = None,
                 lookahead: int = 2, grace_s: float = 60.0):
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {lookahead}")
        self.planner = planner
        self.budget_s = budget_s
        self.lookahead = lookahead
        self.grace_s = grace_s
        self._requests: dict[int, _Request] = {}  # by step: queued, planning or planned, not yet taken
        self._plans: dict[int, IterationPlan] = {}
        self._consumed_mbs = planner.last_mbs
        self._lock = threading.Lock()
        self._waiting: deque[_Request] = deque()  # not yet sent
        self._updates: dict[Callable, tuple] = {}  # update -> args, the latest of each, for the next request
        self._failed: str | None = None  # how the process ended
        self._proc = subprocess.Popen([sys.executable, "-m", plan_worker.__name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._stop = weakref.finalize(self, _stop, self._proc, os.getpid())
        self._busy: _Request | None = (start := _Request(None, None, time.perf_counter() + grace_s))
        self._reader = threading.Thread(target=self._receive, name="pipetune-planner-reader", daemon=True)
        self._reader.start()
        try:
            self._send((planner, meta_fn))
            self._wait(start)
        except BaseException:
            self.close()
            raise

    def _send(self, message) -> None:
        data = _dumps(message)
        try:
            self._proc.stdin.write(data)
            self._proc.stdin.flush()
        except (OSError, ValueError):  # the process ended (or close() closed the pipe): the reader thread reports it
            pass

    def _dispatch(self) -> None:
        """Send the next queued request, with the updates since the last, if the process is idle (lock held)."""
        if self._busy is None and self._waiting and self._failed is None:
            r = self._busy = self._waiting.popleft()
            self._send((list(self._updates.items()), r.step, None if r.deadline is None else r.deadline - time.perf_counter()))
            self._updates.clear()

    def _receive(self) -> None:
        """The reader thread: each answer completes the request in flight and sends the next; when
        the process ends, every open request fails with how it ended."""
        try:
            with self._proc.stdout as answers:
                while True:
                    ok, value = pickle.load(answers)
                    with self._lock:
                        done, self._busy = self._busy, None
                    if ok:
                        done.future.set_result(value)
                    else:
                        error, trace = value
                        error.add_note(f"raised in the pipetune planner process (pid {self._proc.pid}) {done.doing}:\n{trace}")
                        done.future.set_exception(error)
                    with self._lock:
                        self._dispatch()
        except Exception as e:
            ended = _exit_status(self._proc) + ("" if isinstance(e, EOFError) else f" after an unreadable answer ({type(e).__name__}: {e})")
        with self._lock:
            if self._failed is None:
                self._failed = (f"{ended} while {self._busy.doing if self._busy is not None else 'idle'} "
                                "(its own error, if any, is in this job's stderr)")
            for r in [self._busy, *self._waiting]:
                if r is not None:
                    self._fail(r)
            self._busy = None
            self._waiting.clear()

    def _fail(self, r: _Request) -> None:
        r.future.set_exception(PlanError(f"pipetune planner process (pid {self._proc.pid}) {self._failed}"
                                         + ("" if r.step is None else f"; no plan for step {r.step}")))

    def _queue(self, step: int) -> _Request:
        with self._lock:
            if step not in self._requests:
                queued, budget = time.perf_counter(), self.budget_s
                r = self._requests[step] = _Request(step, None if budget is None else queued + budget, queued + (budget or 0) + self.grace_s)
                if self._failed is not None:
                    self._fail(r)
                else:
                    self._waiting.append(r)
                    self._dispatch()
            return self._requests[step]

    def _wait(self, r: _Request):
        try:
            return r.future.result(timeout=max(0.0, r.wait_until - time.perf_counter()))
        except TimeoutError:
            limit = f"{self.grace_s:g} s" if r.step is None else f"its budget ({self.budget_s} s) + {self.grace_s:g} s after it was queued"
            raise PlanError(f"pipetune planner process (pid {self._proc.pid}) did not finish {r.doing} within {limit}") from None

    def _ready(self, step: int, batch_ids=None):
        """Step ``step``'s plan (blocks until it or its fallback is ready; checked against the
        batch's sample ids when given), queueing the next steps'."""
        r = self._queue(step)
        for ahead in range(1, self.lookahead + 1):
            self._queue(step + ahead)
        plan = self._wait(r).validate(batch_ids)
        with self._lock:
            self._requests.pop(step, None)
            self._plans[step] = plan
        return plan

    def __call__(self, meta: BatchMeta) -> list[list[int]]:
        """The packing of ``meta``'s step (as a loader's packing source)."""
        return [list(mb) for mb in self._ready(meta.step, meta.table.ids).micro_batches]

    def plan(self, meta: BatchMeta):
        """``meta``'s plan, taken at once (for a caller that is both loader and training loop); of
        the wrapped planner's type (an ``IterationPlan``, or a ``SharePlanner``'s ``SharePlan``)."""
        return self.plan_step(meta.step, meta.table.ids)

    def plan_step(self, step: int, batch_ids=None):
        """Step ``step``'s plan, taken at once, without this process reading the batch."""
        self._ready(step, batch_ids)
        return self.pop(step)

    def pop(self, step: int):
        """The plan the loader used for ``step`` (each plan is handed out once)."""
        with self._lock:
            if step not in self._plans:
                raise PlanError(f"no plan for step {step}: the loader has not produced that batch yet")
            plan = self._plans.pop(step)
            self._consumed_mbs = plan.mbs
            return plan

    def _update(self, update: Callable, *args) -> None:
        """``update(planner, *args)`` here (checked here, so the process never refuses one) and in
        the process before its next search; ``update`` travels by name (a class's method, or a
        module-level function)."""
        update(self.planner, *args)
        with self._lock:
            self._updates[update] = args

    def set_cost(self, cost) -> None:
        """The wrapped planner's ``set_cost``, from the next search on."""
        self._update(type(self.planner).set_cost, cost)

    def set_correction(self, factors) -> None:
        """The wrapped planner's ``set_correction``, from the next search on."""
        self._update(type(self.planner).set_correction, dict(factors))

    def state_dict(self) -> dict:
        """The fallback's micro-batch size as of the last plan the training loop took (``pop``)."""
        return {"last_mbs": self._consumed_mbs}

    def load_state_dict(self, state: dict) -> None:
        """Drop every plan not yet taken (a search under way finishes unheard) and fall back from ``last_mbs``."""
        mbs = int(state["last_mbs"])
        self._update(_set_last_mbs, mbs)
        with self._lock:
            self._requests.clear()
            self._waiting.clear()
            self._plans.clear()
            self._consumed_mbs = mbs

    def close(self) -> None:
        """End the planner process; plans not yet taken are dropped, and asking for one raises."""
        with self._lock:
            self._failed = self._failed or "was closed"
            self._requests.clear()
        self._stop()
        self._reader.join(timeout=REAP_S)
