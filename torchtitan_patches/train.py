"""Train the VLM with per-iteration plans on a pipeline of ranks (``torchrun``; gloo on CPU).

1. Calibration (``--calibrate-steps``, DIP-style): a few steps of balanced plans at every micro-batch
   size; the measured per-action times fit the latency table's scales and per-call overheads.
2. Every mode in ``--modes`` trains ``--steps`` iterations from the same initial weights and data;
   the modes run in lockstep (step t of each, back to back) so that drifting machine speed does
   not favour one of them. Rank 0 plans off the critical path and broadcasts the plans. With
   ``--online-window W`` rank 0 refits the table to the last W steps of each mode after every
   step and hands the result to the planners (online calibration).

Per step it records the measured pipeline time (first action start to last action end over all
ranks; optimizer and data loading excluded, as in PipeTune; with ``--timing-rounds R`` the median
of R runs of the step's plan, see ``Job.run``), the simulator's prediction, the loss and every
rank's action timeline. Rank 0 prints a summary, writes ``summary.json`` and draws
measured and simulated Gantt charts of one step per mode.

    torchrun --nproc-per-node 2 -m torchtitan_patches.train --data DIR --latency-table T --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from pipetune.cli.common import positive_int
from pipetune.config import load_model_config
from pipetune.cost import CostModel, StageLayout, load_latency_table
from pipetune.data import Overlong
from pipetune.files import write_text_atomic
from pipetune.packing import PackingConfig
from pipetune.plan import Mode, PlannerConfig
from pipetune.plan.async_planner import AsyncPlanner
from pipetune.simulate import TimedAction
from pipetune.simulate.trace import write_trace
from torchtitan_patches.cpu_allocator import retain_freed_memory
from torchtitan_patches.data import DataLoaderConfig
from torchtitan_patches.model.vlm import build_stages, parameter_bytes
from torchtitan_patches.pipeline.calibrate import MeasuredStep, OnlineCalibrator, distinct_plans, held_out_times, simulate_plan
from torchtitan_patches.pipeline.executor import PlanExecutor
from torchtitan_patches.pipeline.plan_channel import PlanChannel


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--latency-table", required=True, help="latency table of this model on this device (pipetune profile)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--gbs", type=positive_int, default=32)
    p.add_argument("--max-seq-len", type=positive_int, default=512)
    p.add_argument("--overlong", choices=[o.value for o in Overlong], default=Overlong.TRUNCATE.value,
                   help="samples longer than --max-seq-len: truncate, reject or error (counted and reported either way)")
    p.add_argument("--max-mbs", type=positive_int, default=4)
    p.add_argument("--mbs", type=positive_int, default=None, help="mbs of the fixed-size modes (default: --max-mbs)")
    p.add_argument("--memory-gib", type=float, default=16.0, help="memory per rank the planner may use")
    p.add_argument("--steps", type=positive_int, default=24)
    p.add_argument("--warmup-steps", type=int, default=2, help="first steps of each mode left out of the timing means")
    p.add_argument("--calibrate-steps", type=int, default=8, help="steps of the calibration phase (0: none)")
    p.add_argument("--online-window", type=int, default=8, help="steps the online calibration refits on (0: off)")
    p.add_argument("--jitter-draws", type=int, default=0,
                   help="draws of per-action noise the planner scores plans over (expected time; 0: deterministic); "
                        "the online calibration fits the noise and measures its makespan factor against the same")
    p.add_argument("--modes", default="original,pipetune", help="comma-separated; a repeated mode runs again (noise check)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="compute dtype: bf16 = autocast with fp32 master weights, gradients and loss (as TorchTitan)")
    p.add_argument("--attention", choices=["auto", "flash", "sdpa"], default="auto", help="attention backend")
    p.add_argument("--strict-order", action="store_true",
                   help="one tag for every message, so gloo pairs messages by posting order as NCCL does (a check)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="timeout of every collective and message of the job")
    p.add_argument("--data-seed", type=int, default=0, help="batch order seed (the calibration phase uses another)")
    p.add_argument("--budget-s", type=float, default=None, help="planning time budget per step (default: none)")
    p.add_argument("--plan-ahead", type=int, default=2,
                   help="steps rank 0 plans ahead in its background thread (0: plan each step just before it runs)")
    p.add_argument("--timing-rounds", type=int, default=1,
                   help="after training, run every step's plan again until it has this many timed runs; a step's time is "
                        "their median (the timing benchmark's noise control)")
    p.add_argument("--trace-step", type=int, default=5, help="step whose timelines are drawn")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.timing_rounds < 1:
        p.error(f"--timing-rounds must be >= 1, got {args.timing_rounds}")
    if args.jitter_draws == 1 or args.jitter_draws < 0:
        p.error(f"--jitter-draws must be 0 (deterministic) or >= 2, got {args.jitter_draws}")
    return args


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Job:
    """One rank's part: model, stage, executor; ``run`` trains a sequence of planned steps.

    ``control`` is a gloo group (with the job's timeout) for plans, digests and timelines, so
    that object collectives stay off NCCL; point-to-point messages use the world group."""

    def __init__(self, args, rank: int, world: int, device: torch.device, control):
        self.args, self.rank, self.world, self.device, self.control = args, rank, world, device, control
        self.model = load_model_config(args.model)
        self.layout = StageLayout.even(self.model.backbone.n_layers, world)
        self.profiled = CostModel(load_latency_table(args.latency_table, model=self.model, tp=1), self.layout)
        self.cost = self.profiled
        window = max(args.online_window * len(args.modes.split(",")), args.calibrate_steps)
        self.calibrator = OnlineCalibrator(self.cost.table, self.layout, window, jitter_draws=args.jitter_draws) if rank == 0 and window else None

    def run(self, make_planners: dict, *, steps: int, data_seed: int, online: bool, rounds: int = 1) -> dict[str, list[dict]]:
        """Train ``steps`` steps of every run in ``make_planners`` (name -> planner factory), each
        from the initial weights, in lockstep: step t of every run back to back, so that drift in
        machine speed hits all runs alike. Rank 0 returns per-step records per run; it refits the
        cost model after each step from step 1 on, and ``online`` also hands it to the planners.

        With ``rounds > 1`` every step's plan is then run again, ``rounds - 1`` more times, in the
        same lockstep order (timing only: gradients are discarded), and a step's measured time is
        the median over the rounds. Repeats minutes apart sample the machine's slow and fast spells
        alike, which back-to-back repeats do not."""
        runs = {name: self._start(make, data_seed, steps) for name, make in make_planners.items()}
        records: dict[str, list[dict]] = {name: [] for name in runs}
        done: list[tuple[str, object, object, dict | None]] = []
        iters = {name: iter(r["loader"]) for name, r in runs.items()}
        for _ in range(steps):
            for name, r in runs.items():
                batch = next(iters[name])
                plan = r["channel"].pop(batch.step)
                rec = self._step(r, batch, plan, online)
                done.append((name, batch, plan, rec))
                if rec is not None:
                    records[name].append(rec)
        for name, r in runs.items():
            if isinstance(r["planner"], AsyncPlanner):
                r["planner"].close()
            if self.rank == 0:
                print(f"{name}: {r['loader'].truncation.describe()}")
        for _ in range(rounds - 1):
            for name, batch, plan, rec in done:
                res = runs[name]["executor"].run(batch, plan)
                runs[name]["opt"].zero_grad(set_to_none=True)
                timed = self._gather_timing(res)
                if timed is not None:
                    rec["measured_runs_s"].append(timed[0])
                    rec["_timelines"].append(timed[1])
        for rec in (rec for recs in records.values() for rec in recs):
            rec["measured_s"] = float(np.median(rec["measured_runs_s"]))
        return records

    def _gather_timing(self, res, extra=()) -> tuple | None:
        """On rank 0: (iteration time from the first action start to the last action end over all
        ranks, every rank's timeline relative to that start, then ``extra`` of every rank); None
        elsewhere."""
        gathered = [None] * self.world
        dist.all_gather_object(gathered, (res.start, res.end, res.timeline, *extra), group=self.control)
        if self.rank != 0:
            return None
        start = min(g[0] for g in gathered)
        timeline = [TimedAction(t.rank, t.action, t.start - start, t.end - start, t.precomputed) for g in gathered for t in g[2]]
        return max(g[1] for g in gathered) - start, timeline, [g[3:] for g in gathered]

    def _start(self, make_planner, data_seed: int, steps: int) -> dict:
        args = self.args
        encoder, stages = build_stages(self.model, list(self.layout.layer_ranges), [self.rank], seed=args.seed, device=self.device,
                                       max_seq_len=args.max_mbs * args.max_seq_len, attention_backend=args.attention)
        stage = stages[self.rank]
        executor = PlanExecutor(stages, encoder, dim=self.model.backbone.dim, rank=self.rank, control_group=self.control,
                                device=self.device, compute_dtype=DTYPES[args.dtype], strict_order=args.strict_order)
        loader = DataLoaderConfig(data=args.data, gbs=args.gbs, max_seq_len=args.max_seq_len, seed=data_seed, max_steps=steps,
                                  overlong=args.overlong, packing=PackingConfig(max_seq_len=args.max_seq_len)).build(self.model)
        planner = make_planner(loader) if self.rank == 0 else None
        channel = PlanChannel(planner.plan if isinstance(planner, AsyncPlanner) else planner, group=self.control)
        loader.packing_source = channel
        opt = torch.optim.AdamW([p for p in stage.parameters() if p.requires_grad], lr=args.lr)
        return {"executor": executor, "opt": opt, "loader": loader, "planner": planner, "channel": channel}

    def _step(self, r: dict, batch, plan, online: bool) -> dict | None:
        res = r["executor"].run(batch, plan)
        r["opt"].step()
        r["opt"].zero_grad(set_to_none=True)
        timed = self._gather_timing(res, (res.loss, res.overhead_s))
        if timed is None:
            return None
        measured, timeline, extra = timed
        meta = r["loader"].meta(batch.step)
        if self.calibrator is not None and batch.step > 0:  # step 0 pays one-off warm-up costs
            self.cost, _ = self.calibrator.update(MeasuredStep.from_timelines(self.profiled, [timeline], plan, meta, measured))
            if online and isinstance(r["planner"], AsyncPlanner):
                r["planner"].planner.set_cost(self.cost)
        return {
            "step": batch.step,
            "measured_runs_s": [measured],
            "predicted_s": plan.predicted_s,
            "loss": next(loss for loss, _ in extra if loss is not None),
            "overhead_ms": 1e3 * max(overhead for _, overhead in extra),
            "micro_batches": plan.num_micro_batches,
            "mbs": plan.mbs,
            "search_ms": 1e3 * plan.search_s,
            "fallback": plan.fallback,
            "_plan": plan,
            "_meta": meta,
            "_timelines": [timeline],
        }

    def planner_factory(self, mode: str):
        args = self.args

        def make(loader):
            cfg = PlannerConfig(mode=mode, max_seq_len=args.max_seq_len, memory_bytes=args.memory_gib * 2**30,
                                max_mbs=args.max_mbs, mbs=args.mbs or args.max_mbs, seed=args.seed, jitter_draws=args.jitter_draws)
            return AsyncPlanner(cfg.build(self.model, self.cost), loader.meta, budget_s=args.budget_s, lookahead=args.plan_ahead)

        return make

    def calibration_planner(self, loader):
        """Balanced plans cycling through every micro-batch size, so per-call costs are identifiable."""
        args = self.args
        planners = [
            PlannerConfig(mode=Mode.BALANCED, max_seq_len=args.max_seq_len, memory_bytes=args.memory_gib * 2**30,
                          max_mbs=args.max_mbs, mbs=k, seed=args.seed).build(self.model, self.cost)
            for k in range(1, args.max_mbs + 1)
        ]
        return lambda meta: planners[meta.step % len(planners)].plan(meta)


def main(argv=None) -> None:
    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=args.timeout_s)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        retain_freed_memory()
        dist.init_process_group("gloo", timeout=timeout)
    dist.barrier()  # every rank joins the world group's first collective (NCCL's batched p2p needs it)
    control = dist.new_group(backend="gloo", timeout=timeout)
    job = Job(args, rank, world, device, control)
    encoder, stages = build_stages(job.model, list(job.layout.layer_ranges), [rank], max_seq_len=args.max_seq_len, device="meta")
    sizes = [None] * world
    dist.all_gather_object(sizes, parameter_bytes(encoder, *stages.values()), group=control)
    if rank == 0:
        print(f"parameter bytes per rank ({args.dtype} compute, fp32 weights, {device.type}): "
              + ", ".join(f"rank {r} {b / 2**20:.1f} MiB" for r, b in enumerate(sizes)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.calibrate_steps:
        job.run({"calibration": job.calibration_planner}, steps=args.calibrate_steps, data_seed=args.data_seed + 1, online=False)
        if rank == 0:
            job.cost.table.save(out / "calibrated_table.json")
            print(f"calibration: {len(job.calibrator.steps)} steps; scales "
                  + ", ".join(f"{k}={v:.2f}" for k, v in job.cost.table.scales.items())
                  + "; per-call overhead " + ", ".join(f"{k}={v * 1e3:.2f} ms" for k, v in job.cost.table.overhead.items()))
    names: dict[str, str] = {}
    for mode in args.modes.split(","):
        names[mode if mode not in names else f"{mode}#{sum(n.split('#')[0] == mode for n in names) + 1}"] = mode
    runs = job.run({name: job.planner_factory(mode) for name, mode in names.items()}, steps=args.steps,
                   data_seed=args.data_seed, online=args.online_window > 0, rounds=args.timing_rounds)
    if rank == 0:
        add_held_out(runs, job.profiled)
        summary = {name: summarise(records, args) for name, records in runs.items()}
        for name, records in runs.items():
            draw(records, name, job.cost, args, out, world)
        report(summary, out, args)
    dist.destroy_process_group()


def add_held_out(runs: dict[str, list[dict]], profiled: CostModel) -> None:
    """``held_out_s`` of every step after the first: its simulated time under the profiled table
    calibrated on the runs of all the other plans of all modes (``held_out_times``; every timing
    round, like the measured time)."""
    recs = [r for records in runs.values() for r in records if r["step"] > 0]
    steps = [MeasuredStep.from_timelines(profiled, r["_timelines"], r["_plan"], r["_meta"], r["measured_s"]) for r in recs]
    if distinct_plans(steps) < 2:
        return
    for r, t in zip(recs, held_out_times(profiled, steps)):
        r["held_out_s"] = t


def summarise(records: list[dict], args) -> dict:
    timed = [r for r in records if r["step"] >= args.warmup_steps]
    measured = np.array([r["measured_s"] for r in timed])
    predicted = np.array([r["predicted_s"] for r in timed])
    held = np.array([(r["held_out_s"], r["measured_s"]) for r in timed if "held_out_s" in r]).reshape(-1, 2)
    return {
        "measured_mean_s": float(measured.mean()),
        "predicted_mean_s": float(predicted.mean()),
        "mean_abs_pct_error": float(np.mean(np.abs(predicted - measured) / measured) * 100),
        "held_out_mean_abs_pct_error": float(np.mean(np.abs(held[:, 0] - held[:, 1]) / held[:, 1]) * 100) if len(held) else None,
        "losses": [r["loss"] for r in records],
        "overhead_ms_mean": float(np.mean([r["overhead_ms"] for r in timed])),
        "search_ms_p50": float(np.median([r["search_ms"] for r in records])),
        "mbs": [r["mbs"] for r in records],
        "steps": [{k: v for k, v in r.items() if not k.startswith("_")} for r in records],
    }


def draw(records: list[dict], mode: str, cost: CostModel, args, out: Path, world: int) -> None:
    pick = next((r for r in records if r["step"] == args.trace_step), records[-1])
    sim = simulate_plan(cost, pick["_plan"], pick["_meta"])
    title = f"{mode}, step {pick['step']}"
    for suffix in ("png", "json"):
        write_trace(pick["_timelines"][0], out / f"{mode}_measured.{suffix}", title=f"{title}: measured on {world} gloo ranks")
        write_trace(list(sim.actions), out / f"{mode}_simulated.{suffix}", title=f"{title}: simulated")


def report(summary: dict, out: Path, args) -> None:
    modes = list(summary)
    if len(modes) > 1:
        base = np.array(summary[modes[0]]["losses"])
        summary["loss_max_abs_diff"] = {m: float(np.max(np.abs(np.array(summary[m]["losses"]) - base))) for m in modes[1:]}
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=1))
    print(f"{args.steps} steps per mode, GBS {args.gbs}, max_seq_len {args.max_seq_len}; timing means skip "
          f"{args.warmup_steps} warm-up steps")
    print(f"{'mode':10} {'measured (s)':>12} {'simulated (s)':>13} {'|error|':>8} {'held out':>9} {'plan overhead':>14}  mbs chosen")
    for m in modes:
        s = summary[m]
        values, counts = np.unique(s["mbs"], return_counts=True)
        chosen = ", ".join(f"{v}: {c}" for v, c in zip(values, counts))
        held = "" if s["held_out_mean_abs_pct_error"] is None else f"{s['held_out_mean_abs_pct_error']:.1f}%"
        print(f"{m:10} {s['measured_mean_s']:12.3f} {s['predicted_mean_s']:13.3f} {s['mean_abs_pct_error']:7.1f}% {held:>9} "
              f"{s['overhead_ms_mean']:11.1f} ms  {chosen}")
    print("simulated = the planner's prediction before the step ran; held out = simulated under the profiled table "
          "calibrated on the runs of every other plan")
    for m in modes[1:]:
        cut = 1 - summary[m]["measured_mean_s"] / summary[modes[0]]["measured_mean_s"]
        sim_cut = 1 - summary[m]["predicted_mean_s"] / summary[modes[0]]["predicted_mean_s"]
        print(f"measured cut of {m} vs {modes[0]}: {cut:.1%} (simulated {sim_cut:.1%}); "
              f"loss curves differ by at most {summary['loss_max_abs_diff'][m]:.2e}")
    print(f"wrote {out}/summary.json and measured/simulated timelines per mode")


if __name__ == "__main__":
    main()
