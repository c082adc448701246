"""Launching the integration tests' rank processes: forked from a fork server (``fork_server.py``)
with the environment torchrun gives its workers, or by torchrun itself where the launch path is
what a test checks."""

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def torchrun(target: list[str], timeout: float = 100, *, ranks: int = 2, check: bool = True, real: bool = False) -> str:
    """``torchrun`` of ``target`` on ``ranks`` local processes (one thread each): forked from the
    fork server (its agent's behaviour: a failed rank stops the others), or with ``real`` by
    torchrun itself. With ``check`` fails the test with the output's tail unless every rank exits
    0, without it unless one fails. Returns the ranks' output in rank order."""
    if real:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", str(port), *target]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=_env())
        assert (res.returncode == 0) == check, res.stdout[-3000:] + res.stderr[-6000:]
        return res.stdout + res.stderr
    runs = forked_ranks(target, timeout, ranks=ranks, agent=True)
    out = "".join(text for _, text in runs)
    assert all(code == 0 for code, _ in runs) == check, f"exit codes {[c for c, _ in runs]}: " + out[-9000:]
    return out


def forked_ranks(target: list[str], timeout: float, *, ranks: int, env: dict[str, str] | None = None, agent: bool = False,
                 hang_ok: bool = False) -> list[tuple[int | None, str]]:
    """The ``ranks`` ranks of ``python TARGET``, forked from the session's fork server
    (``fork_server.py``), meeting at a store this process holds (as torchrun's agent does). Without
    ``agent`` nothing stops the other ranks when one dies: as on ranks of separate nodes, they must
    stop themselves; with it the first rank to fail gets the others stopped, as torchrun's agent
    does. Returns each rank's exit code and output; a rank still running after ``timeout``
    seconds is killed and fails the test, or with ``hang_ok`` gets the code None."""
    import tempfile
    import uuid
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, ranks, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    base = {**_env(env), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks),
            "ROLE_WORLD_SIZE": str(ranks), "GROUP_RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": uuid.uuid4().hex,
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}
    envs = [{**base, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)} for r in range(ranks)]
    with tempfile.TemporaryDirectory() as logs:
        codes = _fork_server().run(target, envs, logs, timeout, agent)
        texts = [(Path(logs) / f"rank{r}.log").read_text(errors="replace") for r in range(ranks)]
    assert hang_ok or None not in codes, f"ranks still running after {timeout} s: " + " | ".join(f"rank {r}: {t[-1500:]}" for r, t in enumerate(texts))
    return list(zip(codes, texts))


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    here = Path(__file__).parent
    return {**os.environ, **(extra or {}), "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(here)])}


class _ForkServer:
    """The client of ``fork_server.py``: one server per test session, restarted if it died."""

    def __init__(self) -> None:
        import tempfile

        self.err = tempfile.NamedTemporaryFile(prefix="fork_server_", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("fork_server.py"))], cwd=ROOT, env=_env(), text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err)

    def run(self, target: list[str], envs: list[dict], logs: str, timeout: float, agent: bool) -> list[int | None]:
        """Every rank's exit code; None for those killed still running after ``timeout`` s."""
        import json
        import select
        import signal
        import time

        self.proc.stdin.write(json.dumps({"argv": target, "envs": envs, "logs": logs, "cwd": str(ROOT), "agent": agent}) + "\n")
        self.proc.stdin.flush()
        pids = json.loads(self._line())["pids"]
        deadline, killed = time.monotonic() + timeout, False
        while not select.select([self.proc.stdout], [], [], max(deadline - time.monotonic(), 0))[0]:
            for p in pids:
                try:
                    os.killpg(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            killed, deadline = True, time.monotonic() + 30
        codes = json.loads(self._line())["codes"]
        return [None if killed and c == -signal.SIGKILL else c for c in codes]

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            self.err.seek(0)
            raise AssertionError("the fork server stopped: " + Path(self.err.name).read_text()[-3000:])
        return line


_server: _ForkServer | None = None


def _fork_server() -> _ForkServer:
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = _ForkServer()
    return _server
