"""The planning core stays free of torch, so planning never touches the training process's CUDA state."""

import pkgutil
import subprocess
import sys

import pipetune


def test_planning_core_never_imports_torch():
    modules = [m.name for m in pkgutil.walk_packages(pipetune.__path__, "pipetune.") if m.name != "pipetune.__main__"]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "bad = sorted(k for k in sys.modules if k == 'torch' or k.startswith(('torch.', 'torchtitan')))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(modules) > 10
