"""``pipetune layout``: propose a stage layout for a job before training (see ``pipetune.plan.layout.layout_search``)."""

from __future__ import annotations

from pipetune.cli.common import (
    add_batch_args,
    add_cost_args,
    add_data_args,
    add_model_args,
    cost_model_from_args,
    emit_json,
    model_from_args,
    positive_float,
    positive_int,
    table_from_args,
)

from pipetune.config import load_hardware
from pipetune.cost import CostModel, StageLayout
from pipetune.plan.layout.planner_config import SplitBackward, separated_excluded
from pipetune.schedule.table import ChunkStyle


def add_layout_args(p, *, default: str) -> None:
    p.add_argument("--layout", default=default, help="backbone layers per stage: even, or e.g. 6,10,9,7; separated: the vision "
                   "encoder in chunks of its own on every rank (DIP); auto: the faster of the searched split and separated")
    p.add_argument("--layout-sample", type=positive_int, default=8, help="sampled batches the layout search scores layouts on")
    p.add_argument("--chunks-per-rank", type=positive_int, default=1, help="virtual stages: backbone chunks per rank (interleaved "
                   "1F1B; --layout then lists pp x chunks-per-rank chunks, even, or auto)")
    p.add_argument("--chunk-style", default=ChunkStyle.LOOP.value, choices=[s.value for s in ChunkStyle],
                   help="how virtual stages sit on ranks: loop (chunk c on rank c mod pp: Interleaved1F1B, InterleavedZeroBubble) "
                        "or v (two per rank, chunks c and 2 pp - 1 - c on rank c: ZBVZeroBubble, DualPipeV; needs "
                        "--chunks-per-rank 2)")
    p.add_argument("--split-backward", default="off", choices=[x.value for x in SplitBackward],
                   help="zero-bubble tables: split backwards into input and weight gradients never, always, or per iteration "
                        "(auto); the best fixed configuration may then split too, and auto layouts are scored with it")
    p.add_argument("--offload", action="store_true", help="where a plan does not fit memory, offload activations to host memory "
                   "(OptPipe's; needs a table with a host link: estimates have one); the best fixed configuration may too")
    p.add_argument("--recompute-encoder", action="store_true", help="recompute a trained ViT's activations in the backward")
    p.add_argument("--memory-gib", type=positive_float, help="GPU memory per rank (default: the --hardware preset's)")


def memory_from_args(args) -> float:
    return args.memory_gib * 2**30 if args.memory_gib else load_hardware(args.hardware).memory_bytes


def cost_and_layout_from_args(args, model, data):
    """The job's cost model on the layout ``--layout`` asks for (``plan`` handles ``separated``
    itself: it compares it with the co-located layouts), and the search result (``None`` unless
    ``auto``, which picks the faster of the best co-located split and the separated layout; with
    virtual stages or split backward, which the separated layout does not run, the best split)."""
    from pipetune.plan.layout.layout_search import LayoutSearch, sample_batches

    base = cost_model_from_args(args, model)
    cost = CostModel(base.table, base.layout, recompute_encoder=args.recompute_encoder)
    if args.layout == "separated":
        raise ValueError("--layout separated is for `pipetune plan`, which compares it with the co-located layouts")
    V, style = args.chunks_per_rank, ChunkStyle(args.chunk_style)
    if style is ChunkStyle.V and V != 2:
        raise ValueError(f"--chunk-style v holds two backbone chunks per rank: add --chunks-per-rank 2 (got {V})")
    cost = cost.with_layout(StageLayout.parse("even" if args.layout == "auto" else args.layout, model.backbone.n_layers, args.pp * V,
                                              chunks_per_rank=V, style=style))
    if args.layout != "auto":
        return cost, None
    sample = sample_batches(
        data, model, gbs=args.gbs, max_seq_len=args.max_seq_len, count=args.layout_sample, seed=args.data_seed, overlong=args.overlong
    )
    split = SplitBackward(args.split_backward)
    search = LayoutSearch(model, cost, sample, max_seq_len=args.max_seq_len, memory_bytes=memory_from_args(args),
                          split_backward=split, seed=args.data_seed, offload=args.offload)
    result = search.search(separated=not separated_excluded(encoder=model.encoder is not None, chunks_per_rank=V, split_backward=split,
                                                            offload=args.offload))
    return cost.with_layout(result.best.layout), result


def register(sub) -> None:
    p = sub.add_parser("layout", help="propose backbone layers per pipeline stage for a job (simulated on sampled batches)")
    add_model_args(p)
    add_data_args(p)
    add_batch_args(p, mbs=None)
    add_cost_args(p)
    add_layout_args(p, default="auto")
    p.set_defaults(run=run)


def run(args) -> int:
    model = model_from_args(args)
    data = table_from_args(args)
    _, result = cost_and_layout_from_args(args, model, data)
    if result is None:
        raise ValueError("pipetune layout proposes a layout: use --layout auto (the default)")
    rows = {
        name: {
            "layers_per_stage": s.layout.layers_per_stage(),
            "predicted_iter_s": s.iter_s,
            "busy_fraction": [float(x) for x in s.busy],
            "peak_gib": [float(x) / 2**30 for x in s.peak_bytes],
        }
        for name, s in (("auto", result.best), ("split", result.split), ("separated", result.separated), ("even", result.even))
        if s is not None
    }
    if args.json:
        emit_json({**rows, "cut_vs_even": result.cut_vs_even, "layouts_scored": result.evaluated, "search_s": result.search_s})
        return 0
    print(f"{model.name} TP{args.tp} PP{args.pp} GBS {args.gbs} max_seq_len {args.max_seq_len}; "
          f"{args.layout_sample} sampled batches, {result.evaluated} layouts scored in {result.search_s:.2f} s")
    print(f"{'layout':9} {'layers per stage':>18} {'iter (s)':>9}  {'busy per stage':>24}  {'peak GiB per stage':>24}")
    for name, r in rows.items():
        print(f"{name:9} {','.join(map(str, r['layers_per_stage'])):>18} {r['predicted_iter_s']:9.3f}  "
              f"{' '.join(f'{x:5.0%}' for x in r['busy_fraction']):>24}  {' '.join(f'{x:5.1f}' for x in r['peak_gib']):>24}")
    print(f"predicted cut vs even: {result.cut_vs_even:.1%}")
    return 0
