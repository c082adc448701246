"""A failed step stops every rank, and each says which rank was lost.

When a rank dies (killed, out of memory) its peers fail in their next collective with the
transport's words ("Connection closed by peer [addr]:port" on gloo, a watchdog timeout on NCCL;
every group has the job's ``comm`` timeouts), which name an address, not a rank, while ranks
blocked on a live peer wait for that peer to exit. So a rank whose step fails posts its step and
error to the job's store (torchrun's agent holds it, so it outlives any worker), and a watcher
thread on every rank, blocked on the store until the first post, makes a rank that is still
inside its step post too ("blocked"). Each rank then waits up to ``grace_s`` for every other
rank's post: a rank that never posts is the lost one. The failing rank raises one line naming the
step and the lost ranks (or, when none was lost, the rank that failed first, with its error); a
blocked rank logs that line and exits with status 1. Nothing is retried: the job restarts from
its last complete checkpoint (DCP writes a checkpoint's ``.metadata`` only after every rank's
data, and TorchTitan takes no step folder without it).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

_PREFIX = "pipetune/stopped/"


def _line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:400]


class JobStop:
    """This rank's part (see the module doc); ``step()`` gives the step it is in."""

    def __init__(self, step: Callable[[], int], grace_s: float):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store, self.step, self.grace_s = dist.distributed_c10d._get_default_store(), step, grace_s
        self._lock = threading.Lock()
        self._posted = False
        watched = self.store.clone()  # a store client per thread: one waiting holds its connection
        threading.Thread(target=self._watch, args=(watched,), name="pipetune-job-stop", daemon=True).start()

    def failed(self, error: BaseException) -> BaseException:
        """The error this rank raises for ``error`` (its own when it failed first and no rank was lost)."""
        try:
            order = self._post(_line(error), self.store)
            if order is None:  # the watcher reported this rank and ends the process
                time.sleep(2 * self.grace_s)
                return error
            return self._verdict(order, error, self.store)
        except Exception as e:  # the store went with the lost rank (a launch without torchrun's agent)
            return RuntimeError(f"pipetune: step {self.step()}: rank {self.rank} stops ({_line(error)}); the job's store is gone too "
                                f"({_line(e)}), so the lost rank is unknown: restart from the last checkpoint")

    def _post(self, what: str, store: dist.Store) -> int | None:
        with self._lock:
            if self._posted:
                return None
            self._posted = True
        order = store.add(_PREFIX + "order", 1)
        store.set(f"{_PREFIX}{self.rank}", f"{order}|{self.step()}|{what}")
        store.set(_PREFIX + "any", "1")
        return order

    def _watch(self, watched: dist.Store) -> None:
        try:
            watched.wait([_PREFIX + "any"], timedelta(days=365))
            time.sleep(0.5)  # a rank whose own step fails now reports its error rather than "blocked"
            order = self._post("blocked in the step", watched)
            if order is None:
                return
            line = str(self._verdict(order, None, watched))
        except Exception:  # the store is gone: the job is ending anyway
            return
        print(line, file=sys.stderr, flush=True)
        os._exit(1)

    def _verdict(self, order: int, error: BaseException | None, store: dist.Store) -> BaseException:
        others = [r for r in range(self.world) if r != self.rank]
        deadline, posted = time.monotonic() + self.grace_s, {}
        while len(posted) < len(others) and time.monotonic() < deadline:
            for r in others:
                if r not in posted and store.check([f"{_PREFIX}{r}"]):
                    posted[r] = store.get(f"{_PREFIX}{r}").decode().split("|", 2)
            time.sleep(0.05)
        lost = [r for r in others if r not in posted]
        here = f"rank {self.rank} stops" + (f" ({_line(error)})" if error is not None else " (blocked in the step)")
        if lost:
            return RuntimeError(f"pipetune: step {self.step()}: lost rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} "
                                f"(no report within {self.grace_s:g} s); {here}: restart from the last checkpoint")
        first, (o, step, what) = min(posted.items(), key=lambda kv: int(kv[1][0]))
        if error is not None and int(o) > order:
            return error
        return RuntimeError(f"pipetune: step {step}: rank {first} failed ({what}); {here}")
