"""``scripts/older_torch``: the import shim that ran the GPU check on a machine with an older torch.
A name listed as missing imports as a placeholder that refuses to be used; a missing module imports
empty; present names and an up-to-date ``varlen_attn`` are left alone."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import torch.nn.attention.varlen as varlen, inspect
from torch.distributed.fsdp import fully_shard, NotInThisTorch
from torch.not_a_module import anything
assert "num_splits" in inspect.signature(varlen.varlen_attn).parameters  # this torch has it: not wrapped
try:
    NotInThisTorch()
except RuntimeError as e:
    print("refused:", e)
print(fully_shard.__name__, anything.__name__)
"""


def test_listed_names_import_as_placeholders_and_present_ones_are_untouched(tmp_path):
    shutil.copy(ROOT / "scripts" / "older_torch" / "sitecustomize.py", tmp_path)
    (tmp_path / "missing.txt").write_text("torch.distributed.fsdp.NotInThisTorch\nmodule torch.not_a_module\n")
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "refused: torch.distributed.fsdp.NotInThisTorch is not in this torch" in res.stdout
    assert "fully_shard anything" in res.stdout
    assert "[shim] torch.distributed.fsdp.NotInThisTorch" in res.stderr and "varlen_attn" not in res.stderr
