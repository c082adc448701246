"""Bad inputs get a clear error naming what is wrong, never a traceback, a hang or a wrong plan.

Table-driven: each case is a command line (or a call) and the message it must print. The
multi-rank plan-channel cases run two gloo processes (this file is also their worker script)
with a short job timeout and a hard test timeout, so a regression fails instead of hanging.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from launch import forked_ranks

ROOT = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 5  # the plan channel's and the job's collectives: a mismatch must end within it


TINY_BACKBONE = "[backbone]\nn_layers = 4\ndim = 128\nffn_dim = 384\nn_heads = 4\nn_kv_heads = 2\nvocab_size = 512\n"
TINY_ENCODER = "[encoder]\nn_layers = 2\ndim = 64\nffn_dim = 128\nn_heads = 2\nimage_size = 32\npatch_size = 8\n"
HARDWARE = (ROOT / "pipetune" / "presets" / "hardware" / "a100.toml").read_text()
PLAN = ["plan", "--pp", "2", "--gbs", "16", "--max-seq-len", "1024", "--mix", "datamix2", "--samples", "200", "--iters", "1"]


def _table(tmp_path, edit=None, *, tp: int = 1, name: str = "table.json") -> str:
    """An analytical latency table of the tiny model, saved after ``edit`` changed its JSON."""
    from pipetune.config import load_hardware, load_model_config
    from pipetune.cost import analytical_table

    raw = analytical_table(load_model_config("tiny"), load_hardware("a100"), tp=tp, max_tokens=256, max_images=2).to_dict()
    if edit:
        edit(raw)
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return str(path)


def _write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _zero(raw, curve, which="fwd"):
    raw["curves"][curve][which] = [0.0] * len(raw["curves"][curve][which])


# Each case: (files to write -> argv, substrings the error must hold). ``{t}`` is the case's tmp dir.
CASES = {
    # item 6: inputs that used to give a wrong plan
    "tp beyond the heads": (lambda t: ["plan", "--model", "13b", "--tp", "64"],
                            ["TP=64 does not divide backbone.n_heads=40", "choose a TP that divides every head count: [1, 2, 4, 8]"]),
    "tp not dividing kv heads (trace)": (lambda t: ["trace", "--model", "tiny", "--tp", "4", "--mix", "datamix2", "--samples", "50"],
                                         ["TP=4 does not divide backbone.n_kv_heads=2, encoder.n_heads=2"]),
    "tp not dividing encoder heads (profile)": (lambda t: ["profile", "--model", "tiny", "--tp", "3", "--out", str(t / "x.json")],
                                                ["TP=3 does not divide backbone.n_heads=4"]),
    "mbs 0": (lambda t: ["plan", "--model", "13b", "--mbs", "0"], ["argument --mbs: must be >= 1, got 0"]),
    "iters 0": (lambda t: ["plan", "--model", "13b", "--iters", "0"], ["argument --iters: must be >= 1, got 0"]),
    "pack iters 0": (lambda t: ["pack", "--mix", "datamix2", "--iters", "0"], ["argument --iters: must be >= 1, got 0"]),
    "table profiled at another TP": (lambda t: PLAN + ["--model", "tiny", "--latency-table", _table(t, tp=2)],
                                     ["was profiled with TP=2, but the job uses TP=1"]),
    "table of another model": (lambda t: PLAN + ["--model", "13b", "--latency-table", _table(t)],
                               ["was profiled for model 'tiny'", "job uses '13b'"]),
    "all-zero curve": (lambda t: PLAN + ["--model", "tiny", "--latency-table", _table(t, lambda r: _zero(r, "rest"))],
                       ["table.json: curve 'rest'.fwd is zero everywhere"]),
    "all-zero backward": (lambda t: PLAN + ["--model", "tiny", "--latency-table", _table(t, lambda r: _zero(r, "head", "bwd"))],
                          ["curve 'head'.bwd is zero everywhere"]),
    "negative curve": (lambda t: PLAN + ["--model", "tiny", "--latency-table",
                                         _table(t, lambda r: r["curves"]["attention"]["fwd"].__setitem__(0, -1.0))],
                       ["curve 'attention'.fwd is negative"]),
    # item 7: wrong types and missing fields in TOML and table files
    "float n_layers": (lambda t: ["plan", "--model", _write(t, "m.toml", TINY_BACKBONE.replace("n_layers = 4", "n_layers = 4.5"))],
                       ["m.toml [backbone]: backbone.n_layers must be an integer, got 4.5"]),
    "missing backbone field": (lambda t: ["plan", "--model", _write(t, "m.toml", TINY_BACKBONE.replace("dim = 128\n", ""))],
                               ["m.toml [backbone]: missing keys ['dim']"]),
    "string encoder field": (lambda t: ["plan", "--model", _write(t, "m.toml", TINY_BACKBONE + TINY_ENCODER + 'frozen = "no"\n')],
                             ["m.toml [encoder]: encoder.frozen must be true or false, got 'no'"]),
    "encoder not a table": (lambda t: ["plan", "--model", _write(t, "m.toml", "encoder = 3\n" + TINY_BACKBONE)],
                            ["m.toml: encoder must be a table or a preset name, got 3"]),
    "hardware wrong type": (lambda t: ["plan", "--model", "13b", "--hardware",
                                       _write(t, "hw.toml", HARDWARE.replace("peak_flops = 312e12", 'peak_flops = "fast"'))],
                            ["hw.toml: hardware.peak_flops must be a finite number, got 'fast'"]),
    "hardware missing field": (lambda t: ["plan", "--model", "13b", "--hardware",
                                          _write(t, "hw.toml", HARDWARE.replace("p2p_latency_s", "# p2p_latency_s"))],
                               ["hw.toml: missing keys ['p2p_latency_s']"]),
    "table tp as a string": (lambda t: PLAN + ["--model", "tiny", "--latency-table", _table(t, lambda r: r.update(tp="1"))],
                             ["tp must be a positive integer, got '1'"]),
    "table curve of strings": (lambda t: PLAN + ["--model", "tiny", "--latency-table",
                                                 _table(t, lambda r: r["curves"]["head"].update(fwd=["1"] * len(r["curves"]["head"]["fwd"])))],
                               ["curve 'head'.fwd must be a flat list of numbers"]),
    "table memory not an object": (lambda t: PLAN + ["--model", "tiny", "--latency-table", _table(t, lambda r: r.update(memory=[1]))],
                                   ["field 'memory' must be a JSON object, got [1]"]),
    "table notes not a list": (lambda t: PLAN + ["--model", "tiny", "--latency-table", _table(t, lambda r: r.update(notes=5))],
                               ["field 'notes' must be a JSON list, got 5"]),
    "table model with a float": (lambda t: PLAN + ["--model", "tiny", "--latency-table",
                                                   _table(t, lambda r: r["model"]["backbone"].update(n_layers=4.0))],
                                 ["model config is malformed (backbone.n_layers must be an integer, got 4.0)"]),
}


def _run_cli(argv: list[str]) -> tuple[int, str]:
    from pipetune.cli.main import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse
            code = e.code
    return code, err.getvalue()


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_a_message_naming_what_to_fix(case, tmp_path):
    make_argv, messages = CASES[case]
    code, err = _run_cli(make_argv(tmp_path))
    assert code == 2, err
    for msg in messages:
        assert msg in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("case", ["float n_layers", "table profiled at another TP", "iters 0"])
def test_the_installed_command_prints_no_traceback(case, tmp_path):
    make_argv, messages = CASES[case]
    res = subprocess.run([sys.executable, "-m", "pipetune", *make_argv(tmp_path)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 2 and messages[0] in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_calibrate_and_the_trainer_refuse_a_table_profiled_at_another_tp(tmp_path, tiny):
    """The runtime runs whole (unsharded) layers: a TP=2 table would time half of every layer."""
    from pipetune.cost import LatencyTableError, load_latency_table

    path = _table(tmp_path, tp=2)
    with pytest.raises(LatencyTableError, match="profiled with TP=2, but the job uses TP=1"):
        load_latency_table(path, model=tiny, tp=1)  # what calibrate (and the trainer) call
    code, err = _run_cli(["calibrate", "--table", path, "--data", str(tmp_path), "--out", str(tmp_path / "c.json")])
    assert code == 2 and "profiled with TP=2, but the job uses TP=1" in err, err


def test_plan_reports_extrapolation_beyond_the_table_grid(tmp_path):
    argv = PLAN + ["--model", "tiny", "--memory-gib", "8", "--latency-table", _table(tmp_path)]
    from pipetune.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    assert "warning: planned beyond the latency table's grid" in out.getvalue()
    assert "rest up to" in out.getvalue() and "(grid ends at 256)" in out.getvalue()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv + ["--json"]) == 0
    extrapolated = json.loads(out.getvalue())["config"]["extrapolated"]
    assert extrapolated["rest"]["grid_end"] == 256 and extrapolated["rest"]["largest"] > 256
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # the analytical table's grid covers the job: nothing to report
        assert main([a for a in argv if a not in ("--latency-table", argv[-1])] + ["--json"]) == 0
    assert json.loads(out.getvalue())["config"]["extrapolated"] == {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["trace", "--model", "tiny", "--pp", "2", "--gbs", "16", "--max-seq-len", "1024", "--mix", "datamix2",
                     "--samples", "200", "--latency-table", _table(tmp_path)]) == 0
    assert "latency lookups beyond the table's grid" in out.getvalue()


def test_a_genuine_bug_keeps_its_traceback(monkeypatch):
    from pipetune.cli import plan_cmd
    from pipetune.cli.main import main

    def broken(args):
        raise KeyError("bug")

    monkeypatch.setattr(plan_cmd, "run", broken)
    with pytest.raises(KeyError):
        main(["plan"])


# ---------------------------------------------------------------- plan channel (two gloo ranks)

def _channel_worker(scenario: str, rank: int) -> None:
    """One rank of a plan-channel scenario; prints ``ERROR <message>`` or ``OK``."""
    import torch.distributed as dist

    import numpy as np

    from pipetune.data import BatchStream, ImageSizing, make_mix
    from pipetune.data.batch import BatchReader
    from pipetune.plan.plan import PlanError, build_plan
    from pipetune.plan.data_parallel.replicas import ReplicaShare
    from torchtitan_patches.runtime.plan_channel import PlanChannel
    from torchtitan_patches.runtime.replica_groups import ReplicaGroups

    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=JOB_TIMEOUT_S))
    data = make_mix("datamix3", 64, seed=0)
    reader = BatchReader(data, BatchStream(num_rows=len(data), gbs=8, seed=0),
                         ImageSizing(patch_size=1, merge=1, standard_grid=4, min_pixels=1, max_pixels=16), 1 << 20)

    def planned(step, idx, replica=0, replicas=1):
        share = reader(step).take(idx)
        return ReplicaShare(replicas, replica).plans(share, build_plan(step=step, micro_batches=[share.table.ids.tolist()], order=[0],
                                                                       num_stages=2, encoder=False, mbs=1, max_seq_len=1 << 20))

    def planner(step):
        return planned(step, np.arange(8))

    try:
        if scenario == "agree":
            ch = PlanChannel(planner if rank == 0 else None)
            groups = [ch.share(s, reader)[1] for s in range(3)]
            assert sorted(groups[2][0]) == sorted(reader(2).table.ids.tolist())
        elif scenario == "steps":  # rank 1 skipped a step (other --steps / --modes)
            ch = PlanChannel(planner if rank == 0 else None)
            ch.share(0 if rank == 0 else 1, reader)
        elif scenario == "no_planner":  # rank 0 started without a planner
            PlanChannel(None)
        elif scenario == "modes":  # rank 0 runs two modes, rank 1 one: rank 0 opens a second channel
            first = PlanChannel(planner if rank == 0 else None)
            if rank == 0:
                PlanChannel(planner)
            first.share(0, reader)
        elif scenario in ("replicas", "overlap", "lead_fails"):  # two replicas of one rank each, each its own lead
            links = ReplicaGroups(dist.new_group(backend="gloo"), (rank,), dist.new_group([0, 1], backend="gloo"), (0, 1))

            def share(step):
                if scenario == "lead_fails" and rank == 1:
                    raise ValueError("no micro-batch size fits this batch")
                mine = (np.arange(4), np.arange(4, 8)) if scenario == "replicas" else (np.arange(5), np.arange(3, 8))
                return planned(step, mine[rank], rank, 2)

            ch = PlanChannel(share, replica=rank, replicas=2, links=links)
            shares = [ch.share(s, reader) for s in range(2)]
            assert len(shares[1][1][0]) == 4 and shares[1][0].totals == reader(1).totals
        elif scenario == "stopped":  # rank 1 dies after joining
            ch = PlanChannel(planner if rank == 0 else None)
            if rank == 1:
                os._exit(0)
            ch.share(0, reader)
        print("OK", flush=True)
    except (PlanError, ValueError) as e:
        print(f"ERROR {type(e).__name__}: {e}", flush=True)
    finally:
        os._exit(0)  # a rank whose peer failed must not wait in destroy_process_group


def _run_channel(scenario: str) -> list[str]:
    return [out for _, out in forked_ranks([__file__, scenario], 3 * JOB_TIMEOUT_S + 20, ranks=2)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "scenario, messages",
    [
        ("agree", ["OK", "OK"]),
        ("steps", ["ranks ask for the plans of different steps (rank 0: step 0, rank 1: step 1)"] * 2),
        ("no_planner", ["rank 0 must own the planner and only it, but ranks [] have one"] * 2),
        ("modes", [f"no answer from the other ranks within {JOB_TIMEOUT_S} s"] * 2),
        ("stopped", [f"no answer from the other ranks within {JOB_TIMEOUT_S} s while asking for the plan of step 0", ""]),
        ("replicas", ["OK", "OK"]),
        ("overlap", ["step 0: the replicas' plans do not partition the global batch (they hold 10 samples of its 8)"] * 2),
        ("lead_fails", ["step 0: another replica's lead could not plan its share", "ValueError: no micro-batch size fits this batch"]),
    ],
)
def test_plan_channel_mismatch_fails_on_every_rank_within_the_timeout(scenario, messages):
    outs = _run_channel(scenario)
    for rank, (out, msg) in enumerate(zip(outs, messages)):
        assert msg in out, f"rank {rank}:\n{out}"
        assert "Traceback" not in out, f"rank {rank}:\n{out}"


# ------------------------------------------- a failed step stops every rank (three gloo ranks)

def _job_stop_worker(scenario: str, rank: int, port: int) -> None:
    """One rank of a job whose step 4 fails on rank 1 (``failed``) or loses rank 2 (``lost``), the
    others blocked in a collective; the job's store (at ``port``) is the test process's, as
    torchrun's agent's is."""
    import signal
    import time

    import torch.distributed as dist

    from torchtitan_patches.runtime.job_stop import JobStop

    store = dist.TCPStore("127.0.0.1", port, world_size=3, is_master=False, timeout=timedelta(seconds=JOB_TIMEOUT_S))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3, timeout=timedelta(seconds=3 * JOB_TIMEOUT_S))
    stop = JobStop(lambda: 4, grace_s=2.0)
    try:
        time.sleep(0.5)
        if scenario == "failed" and rank == 1:
            raise ValueError("row 17 of shard 3 has no text")
        if scenario == "lost" and rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()
        print("OK", flush=True)
    except Exception as e:
        print(f"RAISED {stop.failed(e)}", flush=True)
    os._exit(0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario, codes, messages", [
    ("failed", [1, 0, 1], ["pipetune: step 4: rank 1 failed (ValueError: row 17 of shard 3 has no text); rank 0 stops",
                           "RAISED row 17 of shard 3 has no text",
                           "pipetune: step 4: rank 1 failed (ValueError: row 17 of shard 3 has no text); rank 2 stops"]),
    ("lost", [0, 0, -9], ["RAISED pipetune: step 4: lost rank 2 (no report within 2 s); rank 0 stops",
                          "RAISED pipetune: step 4: lost rank 2 (no report within 2 s); rank 1 stops", ""]),
])
def test_a_failed_step_stops_every_rank_naming_the_failed_or_lost_one(scenario, codes, messages):
    """Where no rank is lost, the failing rank raises its own error and the blocked ones exit 1
    naming it; where one is killed, the others name it within the grace."""
    runs = forked_ranks([__file__, f"stop_{scenario}"], 3 * JOB_TIMEOUT_S + 20, ranks=3)  # the job's store is this process's
    for rank, ((code, out), msg) in enumerate(zip(runs, messages)):
        assert code == codes[rank] and msg in out and "Traceback" not in out, f"rank {rank} ({code}):\n{out}"


if __name__ == "__main__":
    if sys.argv[1].startswith("stop_"):
        _job_stop_worker(sys.argv[1].removeprefix("stop_"), int(os.environ["RANK"]), int(os.environ["MASTER_PORT"]))
    else:
        _channel_worker(sys.argv[1], int(os.environ["RANK"]))
