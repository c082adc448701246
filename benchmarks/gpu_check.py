"""pipetune's runtime on one GPU, checked in one command (``bash scripts/gpu_check.sh``).

Each check prints PASS, FAIL or SKIP with its figures; the exit code is 1 if any check failed.

1. ``profile``: a latency table of ``tiny_wide`` (tiny's shapes at an 8B layer's width; the tiny
   model's latencies on a GPU are kernel launches, flat in the micro-batch's size) on this device
   in bf16, float32 weights under autocast as the executor runs them (``master_weights``),
   written to ``OUT/table.json``. The dry run profiles ``tiny`` in fp32.
2. ``table accuracy``: ``benchmarks/latency_accuracy.py`` with that table on real packed
   micro-batches: mean |error| of stage latencies <= 10 % and Spearman >= 0.95 (issue 3's goal).
3. ``<family> = reference``, for 1F1B, interleaved zero-bubble (two chunks per rank, backwards split
   into ``I`` and ``W``), V-shaped zero-bubble (ZBVZeroBubble's placement), 1F1B with activation
   offload (every chunk but the last of the first half of the micro-batches copied to pinned host
   memory and back on the copy stream; the plan's peak re-simulated with its copies) and DIP's
   separated layout (trained encoder): a pipetune plan of that family
   (the model and table of 1.) for a DataMix2 batch, moved onto this process's one rank (two
   processes cannot share a GPU under NCCL) and run by ``PlanExecutor``, against the
   single-process reference in the same compute dtype: loss within 1e-3 and every gradient
   within 3e-2 (bf16 rounds activations at the stage boundary; the tolerance is the pipeline
   tests', see ``test_bf16_gradients_match_the_bf16_reference``; fp32: 1e-5 and 2e-5).
4. ``<family> host syncs``: the executor's second step synchronises host and device 0 times in
   its action loop (``runtime.host_sync``).
5. ``<family> I/W split`` (split-backward families, a figure, not judged): on a second batch, the
   measured input-gradient (``I``, torch's ``stage_backward_input``) and weight-gradient (``W``)
   seconds, summed over the plan's backbone backwards, against the table's prediction of each
   (its profiled ``bwd_input`` curves) and against the table refitted to the first batch's
   timeline by online calibration (``fit_steps``, which also fits the I/W split). On a GPU, also the
   same step measured with its host queued ahead (``HostAheadClock``: the device sleeps about
   0.15 s at the step's start): if that agrees with the table where the plain step does not, the
   in-pipeline actions waited on their kernels' launches, not on the kernels.
6. ``<family> memory``: the plan's weights plus the most its second step allocated
   (``max_memory_allocated``) does not exceed the plan's predicted peaks of its two ranks, summed
   (an upper bound for one process), by more than 10 %. Left out of both: Adam's moments, which
   the check never allocates, and what the first step left allocated (cuBLAS's workspaces: fixed
   per process, within the planner's ``reserve``). CPU: skipped.

``--dry-run`` runs everything on the CPU in fp32 with small sizes, as CI does: it proves that the
script runs; the timing and memory verdicts (2, 6) are then SKIP, not judged on a shared CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import socket
import sys
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from itertools import islice
from pathlib import Path

import torch
import torch.distributed as dist

from pipetune.calibrate.online import MeasuredStep, fit_steps
from pipetune.config import load_model_config
from pipetune.cost import CostModel, StageLayout
from pipetune.data import make_mix, write_dataset
from pipetune.packing import PackingConfig
from pipetune.plan.layout.planner_config import PlannerConfig
from pipetune.cost.memory import model_state_bytes
from pipetune.schedule import onto_ranks
from pipetune.schedule.offload import with_offload
from pipetune.schedule.table import ChunkStyle, Module, Op
from pipetune.simulate.simulator import durations, simulate
from profiling.profile_layers import DTYPES, ProfileConfig, run_profile
from torchtitan_patches.data import DataLoaderConfig
from torchtitan_patches.models.reference.vlm import build_encoder_chunks, build_stages, build_vlm
from torchtitan_patches.runtime.executor import ImageShapes, PlanExecutor
from torchtitan_patches.runtime.reference import reference_step, whole_model_names
from torchtitan_patches.runtime.timing import QUEUE_AHEAD_CYCLES, ActionTimeline, Clock

MAX_SEQ_LEN = 512
GBS = 16
MIN_MICRO_BATCHES = 3
ROOT = Path(__file__).resolve().parents[1]


class Report:
    def __init__(self):
        self.failed = []

    def __call__(self, name: str, ok: bool | None, detail: str, *, verdict: str | None = None) -> None:
        verdict = verdict or ("SKIP" if ok is None else "PASS" if ok else "FAIL")
        if ok is False:
            self.failed.append(name)
        print(f"{verdict:4}  {name:34} {detail}", flush=True)


def profile(model, device: torch.device, dtype: str, out: Path, dry: bool):
    """The executor runs float32 weights under autocast (no FSDP here): the table is timed so."""
    small = dict(max_tokens=1024, max_images=8, points=3, warmup=1, repeats=2) if dry else {}
    cfg = ProfileConfig(device=device.type, dtype=dtype, max_seq_len=MAX_SEQ_LEN, p2p=False, master_weights=True, **small)
    return run_profile(model, cfg, out, progress=False)


def table_accuracy(table_path: Path, model_name: str, dry: bool, report: Report) -> None:
    """``latency_accuracy.py`` on the profiled table, in this process (torch is imported already)."""
    import latency_accuracy

    sizes = ["--per-mix", "4", "--passes", "1", "--calib", "2", "--samples", "300"] if dry else []
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            latency_accuracy.main(["--table", str(table_path), "--model", model_name, *sizes])
    except Exception:
        report("table accuracy", False, f"latency_accuracy.py failed: {traceback.format_exc()[-1500:]}")
        return
    line = next((ln for ln in out.getvalue().splitlines() if re.match(r"all\s+stages\s", ln)), None)
    if line is None:
        report("table accuracy", False, f"latency_accuracy.py printed no 'all stages' row: {out.getvalue()[-1500:]}")
        return
    print(out.getvalue(), flush=True)
    n, err, rho = line.split()[2:5]
    verdict = None if dry else float(err) <= 10 and float(rho) >= 0.95
    report("table accuracy", verdict, f"{n} stage latencies: mean |err| {err} %, Spearman {rho} (goal <= 10 %, >= 0.95)")


@dataclass(frozen=True)
class Family:
    """One schedule family the executor is checked on: the profiled model's layout on two ranks
    (``chunks`` backbone chunks per rank; ``segments`` encoder segments per rank for DIP's separated
    layout), whether backbone backwards are split into ``I`` and ``W``, and whether the encoder is
    trained."""

    name: str
    chunks: int = 1
    split: bool = False
    segments: int = 0
    trained: bool = False
    style: ChunkStyle = ChunkStyle.LOOP
    offload: bool = False

    def model(self, base):
        return replace(base, encoder=replace(base.encoder, frozen=not self.trained))

    def layout(self, model) -> StageLayout:
        even = StageLayout.even(model.backbone.n_layers, 2 * self.chunks)
        if self.segments:
            return even.separated(model.encoder.n_layers, self.segments, 2)
        return replace(even, chunks_per_rank=self.chunks, style=self.style)


FAMILIES = (
    Family("1F1B"),
    Family("interleaved ZB", chunks=2, split=True),
    Family("V-shaped ZB", chunks=2, split=True, style=ChunkStyle.V),
    Family("1F1B offload", offload=True),
    Family("separated (DIP)", segments=1, trained=True),
)


def offloaded(plan, cost: CostModel, meta):
    """``plan`` with every backbone chunk but the last offloaded for the first half of its
    micro-batches (reloaded one action ahead of the gradient), its peaks simulated with the copies
    (a CPU table has no host link to time them: the plan's own peaks, an upper bound, stay)."""
    pairs = [(c, u) for c in range(plan.num_stages - 1) for u in plan.order[: max(1, plan.num_micro_batches // 2)]]
    table = with_offload(plan.table(), pairs, lead=1).validate()
    peaks = plan.peak_bytes
    if cost.table.host is not None:
        peaks = tuple(float(x) for x in simulate(table, plan.latencies(cost, meta)).peak_bytes + model_state_bytes(cost))
    return replace(plan, ranks=tuple(tuple(str(a) for a in r) for r in table.ranks), peak_bytes=peaks).validate()


def executor_check(family: Family, device: torch.device, compute_dtype: torch.dtype, table, work: Path, report: Report) -> None:
    """A pipetune plan of ``family`` for a DataMix2 batch, moved onto this process's one rank (which
    then holds both ranks' memory), run twice by ``PlanExecutor``: the second step against the
    single-process reference, its host syncs and its peak memory."""
    model = family.model(table.model)  # the table was profiled for it: training the encoder changes no layer's shape
    if not (work / "datamix2" / "pipetune.json").exists():
        write_dataset(make_mix("datamix2", 400, seed=0), work / "datamix2", {"seed": 0})
    layout = family.layout(model)
    planner = PlannerConfig(max_seq_len=MAX_SEQ_LEN, memory_bytes=16 * 2**30, max_mbs=4,
                            split_backward="on" if family.split else "off").build(model, CostModel(replace(table, model=model), layout))
    plans, metas = {}, {}

    def packing(meta):
        plans[meta.step], metas[meta.step] = planner.plan(meta), meta
        return [list(mb) for mb in plans[meta.step].micro_batches]

    loader = DataLoaderConfig(data=work / "datamix2", gbs=GBS, max_seq_len=MAX_SEQ_LEN,
                              packing=PackingConfig(max_seq_len=MAX_SEQ_LEN)).build(model, packing_source=packing)
    # the first batch the planner packs into several micro-batches: a pipeline of one checks little
    batches = (b for b in islice(loader, 50) if plans[b.step].num_micro_batches >= MIN_MICRO_BATCHES)
    batch = next(batches)
    plan = on_one_rank(offloaded(plans[batch.step], planner.cost, metas[batch.step]) if family.offload else plans[batch.step])

    everything = list(range(layout.num_stages))
    if family.segments:
        encoder = build_encoder_chunks(model, list(layout.encoder_chunks), list(range(len(layout.encoder_chunks))), seed=0, device=device)
        _, stages = build_stages(model, list(layout.layer_ranges), everything, max_seq_len=4 * MAX_SEQ_LEN, seed=0, device=device,
                                 colocated_encoder=False)
    else:
        encoder, stages = build_stages(model, list(layout.layer_ranges), everything, max_seq_len=4 * MAX_SEQ_LEN, seed=0, device=device)
    ex = PlanExecutor(stages, encoder, dim=model.backbone.dim, rank=0, device=device, compute_dtype=compute_dtype,
                      image_shapes=ImageShapes.of(model.encoder) if family.segments else None,
                      control_group=dist.new_group(backend="gloo"), count_host_syncs=True)
    allocated = (lambda: torch.cuda.memory_allocated(device)) if device.type == "cuda" else (lambda: 0)
    before = allocated()
    ex.run(batch, plan)  # warm-up: first calls of every shape
    pieces = [("", st) for st in stages.values()] + [("encoder.", c) for c in ex.encoder.values() if family.trained]
    for _, module in pieces:
        module.zero_grad(set_to_none=True)
    base = allocated()  # weights, and what the first step left allocated (library workspaces such as cuBLAS's)
    res = ex.run(batch, plan)
    grads = {prefix + whole_model_names(m)[n]: p.grad for prefix, m in pieces for n, p in m.named_parameters() if p.grad is not None}

    ref_encoder, whole = build_vlm(model, max_seq_len=4 * MAX_SEQ_LEN, seed=0, device=device)
    ref_loss = reference_step(ref_encoder, whole, batch, compute_dtype)
    ref = {**{f"encoder.{n}": p.grad for n, p in ref_encoder.named_parameters() if p.grad is not None},
           **{n: p.grad for n, p in whole.named_parameters() if p.grad is not None}}
    # a ViT's key biases get a zero gradient in exact arithmetic (a softmax ignores a constant added to
    # all of a query's scores): both sides hold rounding noise only, so they are left out, as in the tests
    judged = {n: g for n, g in ref.items() if n in grads and not n.endswith("attn.wk.bias")}
    worst = max((float((grads[n] - g).norm() / g.norm().clamp_min(1e-30)), n) for n, g in judged.items())
    loss_err = abs(res.loss - ref_loss) / abs(ref_loss)
    bf16 = compute_dtype != torch.float32
    ok = set(grads) == set(ref) and loss_err <= (1e-3 if bf16 else 1e-5) and worst[0] <= (3e-2 if bf16 else 2e-5)
    ops = "".join(sorted({a.op.value for r in plan.table().ranks for a in r}))
    name = f"{family.name:15}"
    report(f"{name} = reference", ok, f"{plan.num_micro_batches} micro-batches (mbs {plan.mbs}), actions {ops}, in {compute_dtype}: loss "
           f"{res.loss:.6f} vs {ref_loss:.6f} (rel {loss_err:.1e}); worst gradient rel err {worst[0]:.1e} ({worst[1]}), "
           f"{len(judged)} of {len(ref)} tensors{'' if set(grads) == set(ref) else f'; gradients differ in {sorted(set(grads) ^ set(ref))}'}")
    report(f"{name} host syncs", res.host_syncs == 0, f"{res.host_syncs} in the second step's action loop (goal 0)")
    if family.split:
        step = MeasuredStep.from_timelines(planner.cost, [res.timeline], plan, metas[batch.step], res.elapsed_s)
        fitted = fit_steps(planner.cost, [step])[0]
        held = next(batches)  # a batch the fit has not seen
        held_plan = on_one_rank(plans[held.step])
        ex.run(held, held_plan)
        timeline = ex.run(held, held_plan).timeline
        split_timing({"table": held_plan.latencies(planner.cost, metas[held.step]), "refit": held_plan.latencies(fitted, metas[held.step])},
                     timeline, name, report)
        if device.type == "cuda":
            plain, ex.clock = ex.clock, HostAheadClock(device)
            split_timing({}, ex.run(held, held_plan).timeline, f"{name} host ahead", report)
            ex.clock = plain
    if res.peak_bytes is None:
        report(f"{name} memory", None, "no device allocator statistics on CPU")
    else:
        params = [p for m in (*stages.values(), *ex.encoder.values()) for p in m.parameters()]
        weights = sum(p.numel() * p.element_size() for p in params)
        moments = 8 * sum(p.numel() for p in params if p.requires_grad)  # Adam's, which this check never allocates
        predicted = plan.peak_bytes[0] - moments
        measured = weights + res.peak_bytes - base  # this plan's weights and what its step allocated at most
        report(f"{name} memory", measured <= 1.1 * predicted, f"measured peak {measured / 2**30:.2f} GiB vs predicted "
               f"{predicted / 2**30:.2f} GiB (two ranks' peaks summed, Adam's moments left out; ratio {measured / predicted:.2f}); "
               f"also left out: {(base - before) / 2**20:.0f} MiB the first step left allocated (library workspaces), "
               "within the planner's reserve")


def on_one_rank(plan):
    """``plan`` with every rank's actions on rank 0 (its predicted peak: the ranks' peaks summed)."""
    table = onto_ranks(plan.table(), (0,) * plan.placement.num_ranks)
    return replace(plan, ranks=tuple(tuple(str(a) for a in r) for r in table.ranks), placement=table.placement,
                   peak_bytes=(sum(plan.peak_bytes),)).validate()


class HostAheadTimeline(ActionTimeline):
    """A step's timeline whose device first sleeps (eight of the clock's longest sleeps, about
    0.15 s) while the host queues the step's kernels: where the host is the bottleneck, its
    actions then time their kernels only, as the profiler's ``Clock.measure`` does (a diagnostic)."""

    def start(self) -> None:
        super().start()
        torch.cuda._sleep(8 * QUEUE_AHEAD_CYCLES[1])


class HostAheadClock(Clock):
    def timeline(self) -> ActionTimeline:
        return HostAheadTimeline(self.cuda)


def split_timing(predictions: dict, timeline, name: str, report: Report) -> None:
    """Measured seconds of a step's backbone I and W actions against each of ``predictions``
    (latencies by what priced them)."""
    ops = (Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)
    done = [t for t in timeline if t.action.op in ops and not t.action.is_encoder]

    def split(seconds) -> str:
        i, w = (sum(seconds(t) for t in done if t.action.op is op) for op in ops)
        return f"I {i * 1e3:.2f} ms, W {w * 1e3:.2f} ms (I's share {i / (i + w):.2f})"

    priced = "; ".join(f"{how} {split(lambda t, lat=lat: float(durations(lat, Module.BACKBONE, t.action.op)[t.action.unit, t.action.chunk]))}"
                       for how, lat in predictions.items())
    predicted = f"; predicted by the {priced}" if priced else ""
    report(f"{name} I/W split", None, f"held-out batch: measured {split(lambda t: t.end - t.start)}{predicted}", verdict="INFO")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/gpu_check", help="folder for the latency table and the data")
    ap.add_argument("--dry-run", action="store_true", help="on the CPU, fp32, small sizes: does the script run (CI)")
    args = ap.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device (torch.cuda.is_available() is False); run with --dry-run to exercise the script on the CPU")
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = "float32" if args.dry_run else "bfloat16"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if device.type == "cpu":
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=300), device_id=torch.device("cuda", 0) if device.type == "cuda" else None)
    report = Report()
    print(f"pipetune gpu_check on {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'CPU (dry run)'}, "
          f"torch {torch.__version__}, compute dtype {dtype}", flush=True)
    try:
        table = profile(load_model_config("tiny" if args.dry_run else "tiny_wide"), device, dtype, out / "table.json", args.dry_run)
        report("profile", True, f"{out / 'table.json'} ({table.device}, {table.dtype})")
        table_accuracy(out / "table.json", table.model.name, args.dry_run, report)
        for family in FAMILIES:
            try:
                executor_check(family, device, DTYPES[dtype], table, out, report)
            except Exception as e:  # the other families still run; the traceback is the finding
                traceback.print_exc()
                report(f"{family.name:15} = reference", False, f"{type(e).__name__}: {e}")
    finally:
        dist.destroy_process_group()
    print(f"{'FAILED: ' + ', '.join(report.failed) if report.failed else 'all checks passed'}", flush=True)
    sys.exit(1 if report.failed else 0)


if __name__ == "__main__":
    main()
