"""A fork server for the tests' rank processes: it imports torch, TorchTitan and pipetune once, then
forks every rank of every multi-process test from that state, so that a rank starts in well under
a second instead of re-importing for 5-10 s of CPU (8 ranks sharing 2 cores spent 25-40 s of a
job importing). Started once per test session by ``launch.forked_ranks``; the server itself never
runs a job, so each rank starts from the same imported, unused state.

A child runs like a fresh process (its environment, ``sys.argv``, ``__main__``, atexit handlers,
output in its own file), with three differences a test relies on nowhere: ranks share the server's
hash seed; modules it imported are not imported again (import-time environment variables are
read once, with ``OMP_NUM_THREADS=1``); TorchTitan's rank 0 does not sleep 2 s after training
(``Trainer.train``: "for other ranks to complete"; the ranks meet in ``destroy_process_group``).
The real launch path stays covered: a job test runs under ``torchrun`` itself.

Protocol on stdin / stdout, a JSON line each: a request ``{"argv", "envs", "logs", "cwd", "agent"}``
(``argv`` a script path or ``["-m", module]`` and its arguments, one environment per rank) is
answered with ``{"pids"}`` at once and ``{"codes"}`` when every rank has exited (as ``subprocess``
gives them: negative for a signal). With ``agent``, the first rank to fail gets the others stopped
(SIGTERM, then SIGKILL after 10 s) as torchrun's agent does."""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time
import types

os.environ["OMP_NUM_THREADS"] = "1"

# what the ranks of the integration tests import: the trainer's entry point and its job configs, the
# testbed's trainer, the plan runtime and reference models of the pipeline workers
for module in ("torch.distributed.run", "torchtitan.train", "pipetune_configs", "torchtitan_patches.trainer", "torchtitan_patches.testbed.trainer",
               "torchtitan_patches.runtime.executor", "torchtitan_patches.models.reference.vlm"):
    importlib.import_module(module)


def _run_rank(argv: list[str], env: dict[str, str], log: str, cwd: str) -> int:
    """The rank's program as ``python ARGV`` would run it, in this forked process."""
    import atexit
    import runpy
    import threading
    import traceback

    os.setpgid(0, 0)  # its own group: a timeout kills the rank and what it started (its planner process)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = list(argv[1:]) if argv[0] == "-m" else list(argv)
    trainer_module = sys.modules["torchtitan.trainer"]  # its rank 0 sleeps 2 s after training "for other ranks to complete":
    trainer_module.time = types.SimpleNamespace(perf_counter=time.perf_counter, sleep=lambda s: None)  # 2 s of every test job
    code = 0
    try:
        if argv[0] == "-m":
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:  # what the interpreter's shutdown would do: join threads, run atexit
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def _serve(req: dict) -> dict:
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank, env in enumerate(req["envs"]):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _run_rank(req["argv"], env, os.path.join(req["logs"], f"rank{rank}.log"), req["cwd"])
            finally:
                os._exit(code)
        try:
            os.setpgid(pid, pid)  # also here: a kill right after the fork must find the group
        except OSError:
            pass
        pids.append(pid)
    print(json.dumps({"pids": pids}), flush=True)
    codes: dict[int, int] = {}
    stop_at = None
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if stop_at is not None and time.monotonic() > stop_at:
                _signal([p for p in pids if p not in codes], signal.SIGKILL)
                stop_at = None
            time.sleep(0.05)
            continue
        if pid not in pids:
            continue
        codes[pid] = os.waitstatus_to_exitcode(status)
        if req["agent"] and codes[pid] != 0 and stop_at is None and len(codes) < len(pids):
            _signal([p for p in pids if p not in codes], signal.SIGTERM)
            stop_at = time.monotonic() + 10
    return {"codes": [codes[p] for p in pids]}


def _signal(pids: list[int], sig: int) -> None:
    for p in pids:
        try:
            os.killpg(p, sig)
        except ProcessLookupError:
            pass


def main() -> None:
    for line in sys.stdin:
        print(json.dumps(_serve(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
