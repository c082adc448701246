"""Resume drills (issue 59): a DP 2 x PP 2 job loses a rank while writing a checkpoint; every rank
stops, naming the lost rank and the step; the job resumes from its last complete checkpoint on 2
ranks (DP 1 x PP 2) and on 4 (DP 2 x PP 2), and the stream goes on where it was."""

import shutil
import time
from collections import Counter

import pytest

from pipetune.data import make_mix, write_dataset
from pipetune.records import StepRecord
from launch import forked_ranks, torchrun
from small_job import job_args

pytestmark = pytest.mark.timeout(480)
ROWS, GBS, STEPS = 20, 8, 5  # 5 steps of 8 samples: 2 epochs of 20, a batch across their boundary


def _samples(records: list[StepRecord], step: int) -> list[int]:
    return [i for r in records if r.step == step for mb in r.samples for i in mb]


def _loss(records: list[StepRecord], step: int) -> float:
    return sum(r.loss for r in records if r.step == step)


def test_a_lost_rank_stops_the_job_which_resumes_at_dp_1_and_dp_2(job, tmp_path):
    """Job A (DP 2 x PP 2, checkpoints every 2 steps) has rank 3 killed after it wrote its share of
    the step-4 checkpoint: ranks 0-2 exit non-zero, each naming rank 3 and step 4, and step 4's
    folder has no ``.metadata`` (DCP writes it last), so restarts take step 2's. Restarted on 2
    ranks (B: DP 1 x PP 2) and on 4 (C), each trains steps 3-5: C's steps 3-4 equal A's (samples,
    order, loss); B trains the same samples per step as C, with C's loss up to float summation
    order (a tolerance tighter than any step-to-step change); steps 1-2 (A) and 3-5 train every
    sample twice, once per epoch. B carries A's learned state over (same table and layout)."""
    write_dataset(make_mix("datamix2", ROWS, 3), tmp_path / "data", {"mix": "datamix2"})

    def args(dump, *extra):
        return job_args(job, dump, "--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.interval", "2",
                        "--dataloader.dataset_path", str(tmp_path / "data"), "--comm.init_timeout_seconds", "60",
                        "--comm.train_timeout_seconds", "30", *extra)

    dp2 = ("--parallelism.data_parallel_shard_degree", "2")
    dump_b, dump_c = tmp_path / "b", tmp_path / "c"
    t0 = time.monotonic()
    ranks = forked_ranks(["tests/integration/titan_drill_worker.py", *args(dump_b, *dp2)], 150, ranks=4, env={"KILL_AT_SAVE": "3:4"})
    cost = {"A": time.monotonic() - t0}
    assert ranks[3][0] == -9
    for code, out in ranks[:3]:
        assert code != 0 and "pipetune: step 4: lost rank 3 (no report within 10 s)" in out, out[-3000:]
    assert not (dump_b / "checkpoint" / "step-4" / ".metadata").exists() and any((dump_b / "checkpoint" / "step-4").iterdir())
    first = StepRecord.read(dump_b / "pipetune" / "steps.jsonl")
    shutil.copytree(dump_b, dump_c)
    for dump in (dump_b, dump_c):
        (dump / "pipetune" / "steps.jsonl").unlink()

    t0 = time.monotonic()
    log_b = torchrun(["-m", "torchtitan.train", *args(dump_b)], timeout=150, ranks=2)
    cost["B"] = time.monotonic() - t0
    t0 = time.monotonic()
    log_c = torchrun(["-m", "torchtitan.train", *args(dump_c, *dp2)], timeout=150, ranks=4)
    cost["C"] = time.monotonic() - t0
    print("drill job seconds", {k: round(v, 1) for k, v in cost.items()})
    assert "Training starts at step 3" in log_b and "Training starts at step 3" in log_c
    assert "learned state of 2 replicas carried over to 1" in log_b
    b, c = StepRecord.read(dump_b / "pipetune" / "steps.jsonl"), StepRecord.read(dump_c / "pipetune" / "steps.jsonl")
    assert sorted(r.step for r in b) == [3, 4, 5] and sorted((r.step, r.replica) for r in c) == [(s, d) for s in (3, 4, 5) for d in (0, 1)]

    key = lambda r: (r.step, r.replica)  # noqa: E731
    for x, y in zip(sorted((r for r in first if r.step in (3, 4)), key=key), sorted((r for r in c if r.step in (3, 4)), key=key)):
        assert (x.batch, x.samples, x.order, x.loss) == (y.batch, y.samples, y.order, y.loss), (x.step, x.replica)
    losses = [_loss(first, s) for s in (1, 2)] + [_loss(c, s) for s in (3, 4, 5)]
    tol = 1e-6 * losses[0]
    assert min(abs(u - v) for u, v in zip(losses, losses[1:])) > 2 * tol  # the tolerance tells steps apart
    for s in (3, 4, 5):
        assert sorted(_samples(b, s)) == sorted(_samples(c, s)) and len(set(_samples(c, s))) == GBS
        assert abs(_loss(b, s) - _loss(c, s)) < tol, (s, _loss(b, s), _loss(c, s))
    trained = [_samples(first, s) for s in (1, 2)] + [_samples(b, s) for s in (3, 4, 5)]
    assert set(Counter(i for ids in trained for i in ids).values()) == {2} and len({i for ids in trained for i in ids}) == ROWS
    assert len(set(trained[0] + trained[1])) == 16 and len(set(trained[3] + trained[4])) == 16  # epochs 1 and 2, beside step 3
