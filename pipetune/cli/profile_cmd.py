"""``pipetune profile``: measure a model's latency table on this device (runs ``profiling``)."""

from __future__ import annotations

import time

from pipetune.cli.common import add_model_args, model_from_args, non_negative_int, positive_int


def register(sub) -> None:
    p = sub.add_parser("profile", help="profile per-layer latencies into a latency table (needs torch)")
    add_model_args(p, default="tiny")
    p.add_argument("--out", required=True, help="latency table file to write (JSON)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default=None, help="float32 (default on CPU) or bfloat16 (default on CUDA)")
    p.add_argument("--tp", type=positive_int, default=1, help="profile one tensor-parallel rank's shard of this degree")
    p.add_argument("--max-seq-len", type=positive_int, default=512, help="longest document to measure attention for")
    p.add_argument("--max-tokens", type=positive_int, default=2048, help="longest packed micro-batch to measure")
    p.add_argument("--max-images", type=non_negative_int, default=64, help="most images per micro-batch to measure")
    p.add_argument("--points", type=positive_int, default=10, help="grid points per curve")
    p.add_argument("--repeats", type=positive_int, default=7, help="timed runs per grid point (the median is kept)")
    p.add_argument("--warmup", type=non_negative_int, default=2, help="untimed runs before them")
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (use what training uses)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "flash", "sdpa"],
                   help="document-masked attention kernel to time (auto: what the job would use)")
    p.add_argument("--no-p2p", action="store_true", help="skip the two-process message benchmark")
    p.add_argument("--master-weights", action="store_true",
                   help="keep float32 weights and time under autocast to --dtype (a job without FSDP; prepare_job decides this itself)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args) -> int:
    from profiling.profile_layers import ProfileConfig, run_profile

    model = model_from_args(args)
    model.check_tp(args.tp)
    cfg = ProfileConfig(
        dtype=args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"),
        tp=args.tp,
        device=args.device,
        max_seq_len=args.max_seq_len,
        max_tokens=args.max_tokens,
        max_images=args.max_images if model.encoder is not None else 0,
        points=args.points,
        warmup=args.warmup,
        repeats=args.repeats,
        threads=args.threads,
        p2p=not args.no_p2p,
        attention_backend=args.attention_backend,
        master_weights=args.master_weights,
    )
    t0 = time.perf_counter()
    table = run_profile(model, cfg, args.out, progress=not args.quiet)
    print(f"wrote {args.out}: {table.device}, {cfg.dtype}, TP={cfg.tp}, {time.perf_counter() - t0:.1f} s")
    for name, c in table.curves.items():
        print(f"  {name:9s} {c.x:10s} {len(c.grid):3d} points, fwd {c.fwd[0] * 1e3:8.3f} .. {c.fwd[-1] * 1e3:8.3f} ms")
    for note in table.notes:
        print(f"  note: {note}")
    return 0
