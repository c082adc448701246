"""The built wheel works outside the source tree: presets and the job configs ship in it, the
console script runs, TorchTitan finds the registered jobs.

The wheel is built from a copy of the checkout (``pip wheel --no-deps``, offline, no build
isolation), installed with ``--no-deps`` into a fresh venv in a temporary directory, and that venv
reaches this environment's dependencies through a ``.pth`` line naming their site-packages
(``.pth`` files inside it, such as the editable install's finder, are not run from there, so
the checkout cannot leak in). Nothing touches the network.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP_LEVEL_SKIP = {".git", ".venv", "build", "dist", "out", "data", ".pytest_cache"}


def _ignore(folder: str, names: list[str]) -> set[str]:
    """Leave out build products and local outputs (the checkout's top-level ones only)."""
    skip = {n for n in names if n == "__pycache__" or n.endswith(".egg-info")}
    return skip | (TOP_LEVEL_SKIP & set(names) if Path(folder) == ROOT else set())


def _run(cmd, cwd, env=None, timeout=300) -> subprocess.CompletedProcess:
    res = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{' '.join(map(str, cmd))}\n{res.stdout}\n{res.stderr}"
    return res


@pytest.mark.timeout(400)
def test_wheel_installs_and_runs_plan_and_pack_outside_the_source_tree(tmp_path):
    offline = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    offline.pop("PYTHONPATH", None)
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=_ignore)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", tmp_path / "dist", src],
         cwd=tmp_path, env=offline)
    (wheel,) = (tmp_path / "dist").glob("pipetune-*.whl")

    venv = tmp_path / "venv"
    _run([sys._base_executable, "-m", "venv", venv], cwd=tmp_path, env=offline)
    py = venv / "bin" / "python"
    site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path).stdout.strip())
    (site / "shared_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([py, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel], cwd=tmp_path, env=offline)

    work = tmp_path / "elsewhere"
    work.mkdir()
    # one interpreter (one torch import): where the packages load from; every registered job, as
    # TorchTitan's entry point resolves --module / --config (parsing only); prepare_job's entry point
    out = _run([py, "-c", "import inspect, runpy, sys; import pipetune, profiling, torchtitan_patches as t, pipetune_configs as c\n"
                "print(pipetune.__file__, t.__file__, c.__file__)\n"
                "from pipetune_configs import config_registry as r; from torchtitan.config import ConfigManager\n"
                "for name, fn in inspect.getmembers(r, inspect.isfunction):\n"
                "    if fn.__module__ == r.__name__ and not name.startswith('_'):\n"
                "        print(name, type(ConfigManager().parse_args(['--module', 'pipetune_configs', '--config', name])).__qualname__)\n"
                "sys.argv = ['prepare_job', '--config', 'muse_glimmer_mm', '--out', 'job', '--help']\n"
                "try:\n    runpy.run_module('profiling.prepare_job', run_name='__main__')\n"
                "except SystemExit as e:\n    print('prepare_job exit', e.code)"], cwd=work, env=offline).stdout.split("\n")
    where, jobs = out[0], set(out[1:])
    assert all(Path(p).is_relative_to(site) for p in where.split()), where
    assert {"muse_glimmer_mm PipeTuneTrainer.Config", "muse_glimmer_mm_stock StockTrainer.Config", "muse_glimmer_mm_testbed TestbedTrainer.Config",
            "qwen3_5_debug PipeTuneTrainer.Config", "prepare_job exit 0"} <= jobs, jobs
    assert any(line.startswith("usage:") for line in jobs), jobs

    cli = venv / "bin" / "pipetune"
    plan = json.loads(_run([cli, "plan", "--model", "13b", "--hardware", "a100", "--tp", "4", "--pp", "4", "--gbs", "32",
                            "--mix", "datamix2", "--samples", "500", "--iters", "2", "--json"], cwd=work, env=offline).stdout)
    assert plan["config"]["model"] == "13b" and plan["pipetune"]["mean_iter_s"] > 0
    _run([cli, "data", "make", "--mix", "datamix2", "--samples", "200", "--out", work / "mix"], cwd=work, env=offline)
    pack = _run([cli, "pack", "--data", work / "mix", "--model", "13b", "--gbs", "32", "--iters", "2"], cwd=work, env=offline)
    assert "balanced" in pack.stdout or "micro" in pack.stdout, pack.stdout
