"""Measured vs predicted pipeline time of real TorchTitan training on 2 gloo ranks (this CPU).

What a user runs: TorchTitan's trainer (``torchrun -m torchtitan.train --module pipetune_configs
--config muse_glimmer_mm_testbed``, Muse Glimmer ``debugmodel_mm`` on the CPU testbed,
``torchtitan_patches/testbed``) with pipetune's plans, one job per planner mode (original, balanced, pipetune; pipetune with its
measured guard), through ``benchmarks/titan_jobs.py``.

1. Profile the job's planning shapes on this CPU once (``profiling.prepare_job``).
2. Per data mix, every mode trains ``--calibrate-steps`` calibration steps (balanced plans at
   every micro-batch size, each also run serially to measure the contention kappa; they feed the
   online calibration and are not scored) and then
   ``--steps`` steps, refitting the table online after every step (``--online-window``). Every
   step is a different plan (micro-batch count, sizes, order, encoder placement). The pipetune
   job also runs every ``--tuned-twin-every``-th of those steps' plan serially (tuned twins, not
   scored), and measures kappa on them once it has a few (``PairCalibrator``).
3. Rounds 2..``--rounds``: one job per mix replays the three jobs' recorded plans side by side
   (``--pipetune.replay.path a --testbed.side_by_side b,c,d``): every batch runs each mode's plan back to back, and pipetune's
   plan once more serially (``serial_run``), the first of them rotating with the batch and the
   round. A plan's measured time is the median of its runs (its
   own job's and the side-by-side ones, minutes apart); the measured *cut* comes from the
   side-by-side rounds only, where the plans it compares ran seconds apart, so that the machine's
   drift between jobs (measured at up to 20 points of cut between back-to-back jobs) does not
   enter it.
4. Printed per mix and mode, and overall, over the scored steps: mean |error| and Spearman rank
   correlation of (a) the planner's own prediction, made online before the step ran, and (b) the
   simulator under the profiled table calibrated on every run of all the *other* plans of the mix
   (leave-one-plan-out: accuracy once calibrated, without the planner's lag). Per mix, pipetune's
   cut vs original and vs balanced: measured (side by side), and predicted three ways: by the
   pipetune job's online model for both plans of each batch (the window of steps before it: the
   gain pipetune claims when it plans), by each job's planner for its own plans (three models
   calibrated in three jobs, so the drift between them enters), and by the held-out calibration.
   The noise floor: one run vs the median of its plan's runs, two single runs of the same plan,
   and the cut measured in each side-by-side round (their spread is the measured cut's own
   noise); the guard's fallback steps.
5. Where a predicted cut vs ``original`` goes wrong: with ``P`` pipetune's plans, ``S`` the same
   plans run serially and ``O`` original's, the cut is ``1 - (P/S)(S/O)``. ``P/S`` is what
   contention costs pipetune's plans (the twins' kappa prices it); ``O/S`` compares one large
   micro-batch with several small ones, neither contended (the component fit prices it). Both are
   printed measured (side by side) and predicted by pipetune's model.

``--background N`` runs N CPU-bound processes beside the jobs (contention: the setting in which
plans of many small micro-batches were measured 27 % slower than predicted).

The predicted cut hinges on the contention kappa (``pipetune.simulate.contention``): pipetune's
plans overlap the ranks' work, ``original``'s single micro-batch does not. So the report also
gives the kappa in pipetune's model and the cut its model predicts with kappa held at each of
``--kappas`` (everything else fitted as before). ``--reanalyse`` reports on an earlier run's
records in ``--out`` without running anything (give that run's options).

    .venv/bin/python benchmarks/sim_vs_real.py --out out/sim_vs_real [--background 1]
    .venv/bin/python benchmarks/sim_vs_real.py --out out/sim_vs_real --reanalyse
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from titan_jobs import corpus, prepare, read_records, run_job

os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

from pipetune.data import Overlong  # noqa: E402
from pipetune.packing import PackingConfig  # noqa: E402
from pipetune.plan.plan import IterationPlan  # noqa: E402
from pipetune.plan.data_parallel.replicas import ReplicaPlans  # noqa: E402
from torchtitan_patches.data import DataLoaderConfig  # noqa: E402
from torchtitan_patches.testbed.learning import PairLearner, TestbedRecord  # noqa: E402
from pipetune.serve.learner import call_overhead_s  # noqa: E402
from pipetune.calibrate.online import MeasuredStep, fit_steps, held_out_times, simulate_plan  # noqa: E402
from pipetune.calibrate.pairs import PairCalibrator  # noqa: E402
from pipetune_configs import config_registry  # noqa: E402
from torchtitan_patches.models.model_spec import planning_model_config  # noqa: E402
from pipetune.cost import CostModel, StageLayout, load_latency_table  # noqa: E402

MIXES = ("datamix1", "datamix2", "datamix3")
MODES = ("original", "balanced", "pipetune")
SERIAL = "pipetune_serial"  # pipetune's plans replayed on the serial schedule
REPLAYED = (*MODES, SERIAL)


def run_jobs(mix: str, work: Path, table: Path, args) -> None:
    """Every mode's job of ``mix`` and the side-by-side replays of their plans."""
    out = work / mix
    if not (out / "table.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(table, out / "table.json")
    prepare(out, "muse_glimmer_mm", "--mix", mix, "--samples", str(args.samples))
    common = {**corpus(out, generated=True), "pipetune.latency_table": out / "table.json", "debug.seed": 0,
              "dataloader.gbs": args.gbs, "training.seq_len": args.seq_len, "pipetune.calibration.online_window": args.online_window,
              "pipetune.calibration.steps": args.calibrate_steps, "training.steps": args.calibrate_steps + args.steps,
              "testbed.tuned_twin_every": args.tuned_twin_every}
    for mode in MODES:
        run_job(out / f"{mode}_0", {**common, "pipetune.mode": mode})
    write_serialised(out / "pipetune_0", out / SERIAL / "pipetune" / "steps.jsonl")
    for k in range(1, args.rounds):
        files = [str(out / (name if name == SERIAL else f"{name}_0") / "pipetune" / "steps.jsonl") for name in side_by_side_order(k, REPLAYED)]
        run_job(out / f"side_by_side_{k}", {**common, "pipetune.replay.path": files[0], "testbed.side_by_side": ",".join(files[1:])})


def serial_run(plan: IterationPlan) -> IterationPlan:
    """``plan`` on the serial schedule (no two ranks computing at once) where it has a serial twin
    (``IterationPlan.has_serial_twin``); else ``plan`` itself."""
    return plan.serialised() if plan.has_serial_twin else plan


def write_serialised(job: Path, dest: Path) -> None:
    """``job``'s records with every plan on the serial schedule (``serial_run``): a replay file."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.unlink(missing_ok=True)
    for r in read_records(job):
        if not r.extra_run:
            replace(r, plan=serial_run(IterationPlan.from_json(r.plan)).to_json()).append_to(dest)


def side_by_side_order(k: int, names: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` in the order side-by-side round ``k`` replays them (the first rotates)."""
    return names[k % len(names):] + names[:k % len(names)]


def read_mix(mix: str, work: Path, args) -> dict[str, list[dict]]:
    """The records of ``mix``'s jobs: per mode the scored step records, each with ``runs``
    (measured time per round) and ``measured_s`` (their median); pipetune's also with
    ``serial_runs`` (its plan run serially, per side-by-side round) where the rounds ran them
    (runs before they did replayed the three modes only)."""
    out = work / mix
    jobs = {mode: [read_records(out / f"{mode}_0")] for mode in MODES}
    serial = []
    for k in range(1, args.rounds):
        runs = read_records(out / f"side_by_side_{k}")
        names = REPLAYED if max(r.replay_of for r in runs) == len(MODES) else MODES
        for i, name in enumerate(side_by_side_order(k, names)):
            replayed = [r for r in runs if r.replay_of == i]
            if name == SERIAL:
                serial.append({r.batch: r for r in replayed})
            else:
                jobs[name].append(replayed)
    scored = {}
    for mode, rounds in jobs.items():
        scored[mode] = []
        for rec in rounds[0]:
            if rec.batch < args.calibrate_steps + args.warmup or rec.extra_run:
                continue
            again = [next(x for x in rnd if x.batch == rec.batch) for rnd in rounds]
            assert all((x.samples, x.order) == (rec.samples, rec.order) for x in again), "a replay ran another plan"
            runs = [x.measured_s for x in again]
            scored[mode].append({**vars(rec), "runs": runs, "timelines": [x.timed_actions() for x in again],
                                 "measured_s": float(np.median(runs))})
    if len(serial) == args.rounds - 1:
        for r in scored["pipetune"]:
            r["serial_runs"] = [rnd[r["batch"]].measured_s for rnd in serial]
    config = config_registry.muse_glimmer_mm()
    model = planning_model_config(config.model_spec, image_grid=config.pipetune.image_grid)
    loader = DataLoaderConfig(data=str(out / "data"), gbs=args.gbs, max_seq_len=args.seq_len, seed=0, overlong=Overlong.TRUNCATE,
                              packing=PackingConfig(max_seq_len=args.seq_len)).build(model)
    profiled = CostModel(load_latency_table(out / "table.json", model=model, tp=1), StageLayout.from_sizes(jobs["pipetune"][0][0].layout))
    add_held_out(scored, loader, profiled)
    add_own_view(scored, jobs["pipetune"][0], loader, profiled, args.online_window, args.kappas)
    return scored


def add_held_out(scored: dict[str, list[dict]], loader, profiled: CostModel) -> None:
    """``held_out_s`` per step: the profiled table fitted to every run of the mix's other plans."""
    recs = [r for mode in MODES for r in scored[mode]]
    steps = [MeasuredStep.from_timelines(profiled, r["timelines"], IterationPlan.from_json(r["plan"]), loader.meta(r["batch"]),
                                         r["measured_s"]) for r in recs]
    for r, t in zip(recs, held_out_times(profiled, steps)):
        r["held_out_s"] = t


def add_own_view(scored: dict[str, list[dict]], tuned_job: list[TestbedRecord], loader, profiled: CostModel, window: int,
                 kappas: list[float]) -> None:
    """``own_s`` per scored step of every mode: the time of that mode's plan under the pipetune
    job's online model of the batch (the job's records replayed through ``PairLearner``, the
    learner its trainer ran), so the gain pipetune predicts over another mode is one model's, as
    when it plans; ``own_kappa`` and ``own_overhead_s`` (pipetune's steps): that model's contention
    kappa and per-call overhead. ``held_s[k]``: the same window and anchors fitted with kappa held
    at each of ``kappas`` (how much of the predicted cut is kappa's)."""
    by_batch = {mode: {r["batch"]: r for r in recs} for mode, recs in scored.items()}
    learner = PairLearner(profiled, calibrator=PairCalibrator(profiled.table, profiled.layout, window))
    calibrator = learner.calibrator
    for r in tuned_job:
        if r.batch in by_batch["pipetune"] and not r.extra_run:
            cost, fitted = calibrator.fit()
            by_batch["pipetune"][r.batch].update(own_kappa=fitted.contention, own_overhead_s=call_overhead_s(cost.table))
            costs = {k: fit_steps(CostModel(replace(calibrator.held().table, contention=k), profiled.layout), calibrator.steps,
                                  anchors=calibrator.anchors(), fit_contention=False, fit_overhead=calibrator.overhead is None)[0]
                     for k in kappas}
            for mode in MODES:
                x = by_batch[mode][r.batch]
                plan, meta = IterationPlan.from_json(x["plan"]), loader.meta(x["batch"])
                x["own_s"] = simulate_plan(cost, plan, meta).makespan
                if "serial_runs" in x:
                    x["own_serial_s"] = simulate_plan(cost, serial_run(plan), meta).makespan
                x["held_s"] = {k: simulate_plan(c, plan, meta).makespan for k, c in costs.items()}
        learner.observe([replace(r)], ReplicaPlans(r.batch, (IterationPlan.from_json(r.plan),)), loader.meta(r.batch))


def errors(measured, predicted) -> tuple[float, float]:
    m, p = np.asarray(measured), np.asarray(predicted)
    return float(np.mean(np.abs(p - m) / m) * 100), float(spearmanr(m, p).statistic) if len(m) > 2 else float("nan")


def report(results: dict[str, dict[str, list[dict]]], args) -> None:
    print(f"\n{'':26} {'planner, online':>28} {'held-out calibration':>22}")
    print(f"{'mix':9} {'mode':9} {'plans':>5} {'measured':>9} {'predicted':>10} {'|error|':>8} {'spearman':>9} "
          f"{'|error|':>9} {'spearman':>9}")
    every = []
    for mix, scored in results.items():
        for mode, recs in scored.items():
            m = [r["measured_s"] for r in recs]
            e, rho = errors(m, [r["predicted_s"] for r in recs])
            he, hrho = errors(m, [r["held_out_s"] for r in recs])
            print(f"{mix:9} {mode:9} {len(recs):5d} {np.mean(m):9.3f} {np.mean([r['predicted_s'] for r in recs]):10.3f} {e:7.1f}% "
                  f"{rho:9.3f} {he:8.1f}% {hrho:9.3f}")
            every += recs
    m = [r["measured_s"] for r in every]
    e, rho = errors(m, [r["predicted_s"] for r in every])
    he, hrho = errors(m, [r["held_out_s"] for r in every])
    print(f"{'all':9} {'':9} {len(every):5d} {'':9} {'':10} {e:7.1f}% {rho:9.3f} {he:8.1f}% {hrho:9.3f}")
    spread = np.mean([abs(x - r["measured_s"]) / r["measured_s"] for r in every for x in r["runs"]]) * 100
    pair = np.mean([abs(r["runs"][0] - r["runs"][1]) / r["measured_s"] for r in every]) * 100
    print(f"noise: one run vs the median of its plan's {args.rounds} runs {spread:.1f}% (mean |difference|); "
          f"two runs of one plan {pair:.1f}%")
    for mix, scored in results.items():
        side = {mode: np.array([r["runs"][1:] for r in recs]) for mode, recs in scored.items()}  # [plan, side-by-side round]
        measured = {mode: np.median(t, axis=1) for mode, t in side.items()}
        for base in ("original", "balanced"):
            pred = {key: predicted_cut(scored, lambda r, key=key: r[key], base) for key in ("own_s", "predicted_s", "held_out_s")}
            rounds = "/".join(f"{1 - p.sum() / b.sum():+.1%}" for p, b in zip(side["pipetune"].T, side[base].T))
            held = "/".join(f"{predicted_cut(scored, lambda r, k=k: r['held_s'][k], base):+.1%}" for k in args.kappas)
            print(f"{mix}: pipetune vs {base}: measured {cut(measured, base):+.1%} (side-by-side rounds {rounds}); predicted by "
                  f"pipetune's model {pred['own_s']:+.1%}, by each job's planner {pred['predicted_s']:+.1%}, held-out "
                  f"{pred['held_out_s']:+.1%}; pipetune's model with kappa held at {'/'.join(map(str, args.kappas))}: {held}")
        if "serial_runs" in scored["pipetune"][0]:
            tuned = scored["pipetune"]
            s_meas = sum(np.median(r["serial_runs"]) for r in tuned)
            s_pred = sum(r["own_serial_s"] for r in tuned)
            print(f"{mix}: the cut vs original as 1 - (P/S)(S/O), P pipetune's plans, S the same run serially, O original's: "
                  f"P/S measured {measured['pipetune'].sum() / s_meas:.3f}, predicted {sum(r['own_s'] for r in tuned) / s_pred:.3f} "
                  f"(contention); O/S measured {measured['original'].sum() / s_meas:.3f}, predicted "
                  f"{sum(r['own_s'] for r in scored['original']) / s_pred:.3f} (one micro-batch vs several, uncontended)")
        kappa = [r["own_kappa"] for r in scored["pipetune"]]
        overhead = [1e3 * r["own_overhead_s"] for r in scored["pipetune"]]
        print(f"{mix}: kappa in pipetune's model (measured on serial runs where the job ran them: calibration twins, then "
              f"tuned twins): mean {np.mean(kappa):.2f}, range {min(kappa):.2f}-{max(kappa):.2f}; per-call overhead (stage forward + "
              f"backward; measured on size twins where the job ran them): {min(overhead):.1f}-{max(overhead):.1f} ms")
        kinds = [r.get("kind") for r in scored["pipetune"]]
        print(f"{mix}: guard ran the baseline on {kinds.count('baseline')} of {len(kinds)} steps "
              f"({sum(r.get('guard') == 'fallback' for r in scored['pipetune'])} in fallback)")


def predicted_cut(scored: dict[str, list[dict]], time_of, base: str) -> float:
    """``cut`` of the times ``time_of(record)`` of every mode's scored steps."""
    return cut({mode: np.array([time_of(r) for r in recs]) for mode, recs in scored.items()}, base)


def cut(times: dict[str, np.ndarray], base: str) -> float:
    """Pipetune's cut of the summed time of the same batches vs mode ``base``."""
    return float(1 - times["pipetune"].sum() / times[base].sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument("--steps", type=int, default=16, help="scored steps per job (after the calibration steps)")
    ap.add_argument("--warmup", type=int, default=1, help="first steps after calibration left out of the scores")
    ap.add_argument("--calibrate-steps", type=int, default=16, help="calibration steps per job; those of several "
                    "micro-batches also run serially, the pairs kappa is measured on (8 steps gave 3-5 pairs per job, and "
                    "under one CPU-bound process kappa came out 0.5-0.8 from run to run; 16 gave 5-11)")
    ap.add_argument("--online-window", type=int, default=8)
    ap.add_argument("--tuned-twin-every", type=int, default=2, help="the pipetune job runs every Nth step after calibration "
                    "also serially, and measures kappa on those twins (0: on the calibration's twins only)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of every plan (>= 2: the first trains, the others replay "
                    "the modes' plans side by side)")
    ap.add_argument("--gbs", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--background", type=int, default=0, help="CPU-bound processes to run beside the jobs")
    ap.add_argument("--kappas", default="0,0.1,0.25,0.5", type=lambda v: [float(x) for x in v.split(",")],
                    help="contention kappas at which pipetune's model is also fitted with kappa held")
    ap.add_argument("--reanalyse", action="store_true", help="report on the jobs already in --out (same options as that run) "
                    "instead of running them")
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be >= 2: the measured cut comes from the side-by-side replays")
    mixes = args.mixes.split(",")
    if args.reanalyse:
        if args.out is None:
            ap.error("--reanalyse needs --out: the directory of an earlier run")
        jobs = [f"{mode}_0" for mode in MODES] + [f"side_by_side_{k}" for k in range(1, args.rounds)]
        missing = [str(args.out / mix / job) for mix in mixes for job in jobs if not (args.out / mix / job / "pipetune").is_dir()]
        if missing:
            ap.error(f"--reanalyse: no records of these jobs (run with the options of that run): {', '.join(missing)}")
    work = args.out or Path(tempfile.mkdtemp(prefix="pipetune-sim-vs-real-"))
    work.mkdir(parents=True, exist_ok=True)
    if not args.reanalyse:
        prepare(work / "profile", "muse_glimmer_mm", "--samples", "200")
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.background)]
        try:
            for mix in mixes:
                run_jobs(mix, work, work / "profile" / "table.json", args)
        finally:
            for h in hogs:
                h.kill()
    results = {mix: read_mix(mix, work, args) for mix in mixes}
    print(f"TorchTitan muse_glimmer debugmodel_mm, 2 gloo ranks, GBS {args.gbs}, seq_len {args.seq_len}; per job "
          f"{args.calibrate_steps} calibration + {args.steps} steps ({args.warmup} left out), online window {args.online_window}, "
          f"{args.rounds} runs per plan; " + (f"re-analysed from {work}" if args.reanalyse else
                                              f"{args.background} CPU-bound background process(es)"))
    report(results, args)
    (work / "summary.json").write_text(json.dumps({mix: {mode: [{k: v for k, v in r.items() if k != "timelines"} for r in recs]
                                                         for mode, recs in s.items()} for mix, s in results.items()}))
    print(f"records in {work}")


if __name__ == "__main__":
    main()
