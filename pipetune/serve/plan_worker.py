"""``AsyncPlanner``'s planner process: ``python -m pipetune.serve.plan_worker`` (see
``pipetune.serve.async_planner`` for why a process).

It imports the planning core only, never torch. Pickles on stdin: first the planner and the
function that reads a batch's metadata, then one request at a time, ``(updates, step,
remaining_s)``: it applies ``updates`` (``(function, args)`` calls on the planner, such as its
class's ``set_cost``, made since the previous request), reads batch ``step`` and plans it with a deadline
``remaining_s`` from now (``None``: none) and writes ``(True, plan)``, or ``(False, (exception,
traceback))`` if planning raised, to stdout. Answer ``(True, None)`` says the planner arrived. It
exits when stdin closes.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import time
import traceback
from typing import BinaryIO

from pipetune.plan.plan import PlanError


def _portable(e: Exception) -> Exception:
    """``e`` if it survives pickling both ways (the parent re-raises it), else a ``PlanError``
    with its message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return PlanError(f"{type(e).__name__}: {e}")


def _answer(out: BinaryIO, ok: bool, value) -> None:
    pickle.dump((ok, value), out, pickle.HIGHEST_PROTOCOL)
    out.flush()


def serve(requests: BinaryIO, answers: BinaryIO) -> None:
    planner, read = pickle.load(requests)
    _answer(answers, True, None)
    while True:
        try:
            updates, step, remaining = pickle.load(requests)
        except EOFError:
            return
        try:
            for update, args in updates:
                update(planner, *args)
            deadline = None if remaining is None else time.perf_counter() + remaining
            answer = True, planner.plan(read(step), deadline=deadline)
        except Exception as e:
            answer = False, (_portable(e), traceback.format_exc())
        _answer(answers, *answer)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it ends this process
    logging.basicConfig(format="pipetune planner process: %(levelname)s %(name)s: %(message)s")
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to stderr, not into the answers
    serve(sys.stdin.buffer, answers)


if __name__ == "__main__":
    main()
