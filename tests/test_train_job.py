"""The main job end to end on 2 gloo ranks (few steps): summary, loss agreement, timelines."""

import json
import os
import subprocess
import sys

import pytest

from pipetune.config import load_hardware, load_model_config
from pipetune.cost import analytical_table


def test_train_job_runs_both_modes_with_equal_losses(datamix2_dir, tmp_path):
    table = tmp_path / "table.json"
    analytical_table(load_model_config("tiny"), load_hardware("h100")).save(table)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "torchtitan_patches.train",
           "--data", str(datamix2_dir), "--latency-table", str(table), "--out", str(out), "--steps", "4",
           "--calibrate-steps", "3", "--warmup-steps", "1", "--gbs", "8", "--trace-step", "2", "--timing-rounds", "2",
           "--strict-order"]  # the planner's plans, messages paired by posting order only
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert "measured cut of pipetune vs original" in res.stdout
    assert "parameter bytes per rank" in res.stdout and "rank 1 " in res.stdout
    summary = json.loads((out / "summary.json").read_text())
    for mode in ("original", "pipetune"):
        s = summary[mode]
        assert len(s["losses"]) == 4 and s["measured_mean_s"] > 0 and s["predicted_mean_s"] > 0
        assert (out / f"{mode}_measured.png").stat().st_size > 5000 and (out / f"{mode}_simulated.json").is_file()
        for step in s["steps"]:  # two timing rounds: the training run and one replay of the same plan
            assert len(step["measured_runs_s"]) == 2 and step["measured_s"] == pytest.approx(sum(step["measured_runs_s"]) / 2)
        assert all(step["held_out_s"] > 0 for step in s["steps"] if step["step"] > 0)
        assert s["held_out_mean_abs_pct_error"] is not None
    assert summary["loss_max_abs_diff"]["pipetune"] < 1e-4  # same data, same initial weights, same maths
    assert (out / "calibrated_table.json").is_file()
