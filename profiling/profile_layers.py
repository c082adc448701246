"""Offline profiling (PipeTune App. A.4): per-component latency curves of a model into a latency table.

Measured on the current device, with the runtime's own modules:

* attention of one decoder layer over documents of each length (the runtime's ``PackedAttention``:
  TorchTitan's varlen attention on CUDA in bf16 / fp16, per-document PyTorch SDPA otherwise),
  forward and backward. A packed micro-batch pays the attention call's fixed cost once and a
  per-document cost per document, so each length is timed as one document and as ``k`` documents
  packed together: the per-document cost is the difference over ``k - 1`` and is what the
  ``attention`` curve holds;
* one whole decoder layer over each packed length; non-attention cost (``rest``) = layer minus
  its attention, as the paper does (so ``rest`` carries the attention call's fixed cost). The
  packed sequence is cut into documents of ``REST_DOC_LEN`` tokens: attention is then a small,
  well-measured part of the layer, so the difference is not swamped by timing noise (with one
  document of 2048 tokens attention is 3/4 of the layer and 5 % noise in it is 15 % in ``rest``),
  and no document is longer than real ones are;
* for a model with linear-attention layers (``BackboneConfig.linear_attention``), the model's own
  Gated DeltaNet layer (``models.qwen3_5.cpu_paths.gated_delta_net``: fla's Triton kernels on CUDA, the torch
  path of ``models.qwen3_5.gated_delta_cpu`` otherwise) over packed lengths that are whole chunks, cut into
  documents of up to ``max_seq_len`` tokens, and its projections alone over the same tokens: the
  ``linear_attention`` curve is the layer minus its projections (a linear-attention layer's
  projections and FFN are charged as ``rest``);
* token embedding and the final norm + output head + loss over packed lengths;
* the projector over image counts, and the vision encoder's forward (backward too when trainable);
* saved-for-backward bytes per token of a layer, the embedding and the head, and per image of the
  projector: the activation memory the micro-batch-size bound uses;
* with ``p2p``: two local processes ping-pong hidden-state-sized messages (``profiling.p2p``).

Every backward is also timed as its input-gradient part alone (``bwd_input``: after an untimed
forward, ``autograd.grad`` towards the inputs that require grad, which runs no weight-gradient
kernel; what a split backward's ``I`` does); derived curves take the same differences of it, the
embedding (token ids) has none, and each is cut to its whole backward (timed apart, it can exceed
it a little).

Timing goes in passes over all grid points (``warmup`` untimed passes, then ``repeats`` timed
ones, each in a new random order), and each point takes the median of its samples: a burst of
machine noise then hits one sample of many points instead of every sample of one point, and no
point is always timed right after the same neighbour (which would bias small, cache-sensitive
calls). CUDA events time GPU work, each region queued behind a sleep kernel as a pipeline's host
runs ahead of its device (``runtime.timing.Clock``). Curves are then made non-decreasing with isotonic regression
(timing noise on small sizes would otherwise be refused by the table loader); the largest
adjustment is recorded in the table's notes. With ``tp > 1`` the modules are one rank's shard:
TP collectives are not measured.

Partial results go to ``OUT.partial.json`` after every pass (written atomically); re-running with
the same settings and sample fields (``SAMPLE``) resumes from there, and an unreadable partial file
is reported and ignored.
"""

from __future__ import annotations

import copy
import json
import platform
import sys
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.isotonic import IsotonicRegression
from tqdm import tqdm

from pipetune.config.model import ModelConfig
from pipetune.cost.latency_table import Curve, LatencyTable
from pipetune.files import write_text_atomic
from profiling.host_link import measure_host_link
from torchtitan_patches.compat.cpu_allocator import retain_freed_memory
from torchtitan_patches.models.reference.blocks import decoder_layer_config
from torchtitan_patches.models.packed_attention import PackedAttention, flash_attn_available, varlen_metadata
from torchtitan_patches.models.reference.vlm import Projector, VisionEncoder
from torchtitan_patches.runtime.timing import Clock, fwd_bwd_sample, input_grad_sample, saved_activation_bytes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAMPLE = ("fwd", "bwd", "bwd_input")  # a sample's fields; in the resume file's header, so older partial files are not resumed
REST_DOC_LEN = 64


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """What to profile and how hard. ``max_seq_len`` bounds document lengths, ``max_tokens`` packed
    micro-batch lengths, ``max_images`` images per micro-batch; larger inputs are extrapolated by
    the cost model (and flagged). ``master_weights``: weights stay in float32 and every forward runs
    under autocast to ``dtype``, as pipetune's executor trains in reduced precision without FSDP
    (each forward then casts its weights, and keeps the copies for its backward); otherwise the
    weights are held in ``dtype``, as FSDP's mixed-precision policy gathers them."""

    dtype: str = "float32"
    tp: int = 1
    device: str = "cpu"
    max_seq_len: int = 512
    max_tokens: int = 2048
    max_images: int = 64
    points: int = 10
    warmup: int = 2
    repeats: int = 7
    threads: int = 1
    p2p: bool = True
    attention_backend: str = "auto"
    seed: int = 0
    master_weights: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if min(self.max_seq_len, self.max_tokens, self.points, self.repeats, self.tp) < 1 or self.max_images < 0:
            raise ValueError("max_seq_len, max_tokens, points, repeats and tp must be >= 1")
        if self.max_tokens < self.max_seq_len:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be >= max_seq_len ({self.max_seq_len})")

    @property
    def under_autocast(self) -> bool:
        """Whether forwards are timed under autocast: master weights in a reduced dtype (in float32
        there is nothing to cast)."""
        return self.master_weights and self.dtype != "float32"


def _geom(lo: int, hi: int, n: int) -> list[int]:
    return sorted({int(round(x)) for x in np.geomspace(lo, hi, n)} | {hi})


def packed_docs(length: int, max_tokens: int) -> int:
    """How many documents of ``length`` to pack together when timing the per-document cost."""
    return int(min(16, max(2, max_tokens // length)))


def layer_doc_bounds(packed_len: int) -> list[int]:
    """Document boundaries of the sequence a layer is timed on: ``REST_DOC_LEN``-token documents
    and a shorter last one."""
    return sorted(set(range(0, packed_len, REST_DOC_LEN)) | {packed_len})


def linear_doc_bounds(packed_len: int, doc_len: int) -> list[int]:
    """Document boundaries of the sequence a linear-attention layer is timed on: ``doc_len``-token
    documents and a shorter last one."""
    return sorted(set(range(0, packed_len, doc_len)) | {packed_len})


def linear_doc_len(model: ModelConfig, cfg: ProfileConfig) -> int:
    """Length of those documents: ``max_seq_len`` rounded down to whole chunks (at least one)."""
    chunk = model.backbone.linear_attention.chunk
    return max(1, cfg.max_seq_len // chunk) * chunk


def grids(cfg: ProfileConfig, model: ModelConfig | None = None) -> dict[str, list[int]]:
    """Sizes profiled per kind of curve; ``linear`` (whole chunks) only for a model with linear-attention layers."""
    packed = _geom(16, cfg.max_tokens, cfg.points + 2)
    out = {
        "attention": sorted(set(_geom(1, cfg.max_seq_len, cfg.points)) | set(packed)),
        "packed": packed,
        "images": _geom(1, cfg.max_images, max(2, cfg.points - 2)) if cfg.max_images else [],
    }
    la = model.backbone.linear_attention if model is not None else None
    if la is not None:
        top = -(-cfg.max_tokens // la.chunk)
        out["linear"] = [la.chunk * n for n in _geom(1, top, cfg.points + 2)]
    return out


def measurement_tasks(model: ModelConfig, cfg: ProfileConfig) -> list[tuple[str, int]]:
    """Every (curve, size) point one profiling pass measures."""
    g = grids(cfg, model)
    tasks = [(c, x) for c in ("attention", "attention_packed") for x in g["attention"]]
    tasks += [(c, x) for c in ("layer", "embedding", "head") for x in g["packed"]]
    tasks += [(c, x) for c in ("linear_layer", "linear_projections") for x in g.get("linear", [])]
    if model.encoder is not None:
        tasks += [(c, x) for c in ("projector", "encoder") for x in g["images"]]
    return tasks


class _Profiler:
    def __init__(self, model: ModelConfig, cfg: ProfileConfig):
        self.model, self.cfg = model, cfg
        self.device = torch.device(cfg.device)
        self.dtype = DTYPES[cfg.dtype]
        self.clock = Clock(self.device)
        b, tp = model.backbone, cfg.tp
        torch.manual_seed(cfg.seed)
        self.attention = PackedAttention.Config(causal=True, backend=cfg.attention_backend).build()
        self.layer = self._prep(decoder_layer_config(b, max_seq_len=cfg.max_tokens, attention_backend=cfg.attention_backend, tp=tp).build())
        self.layer.init_states()
        self.embedding = self._prep(torch.nn.Embedding(b.vocab_size // tp, b.dim))
        self.norm = self._prep(torch.nn.RMSNorm(b.dim, eps=b.norm_eps))
        self.head = self._prep(torch.nn.Linear(b.dim, b.vocab_size // tp, bias=False))
        enc = model.encoder
        self.projector = self._prep(Projector(enc.merged_dim, b.dim, tp)) if enc else None
        self.encoder = self._prep(VisionEncoder(enc, tp)) if enc else None
        self.delta_net = None
        if b.linear_attention is not None:
            from torchtitan_patches.models.qwen3_5.cpu_paths import gated_delta_net

            self.delta_net = self._prep(gated_delta_net(b, tp=tp))
            self.linear_doc_len = linear_doc_len(model, cfg)

    def _prep(self, module: torch.nn.Module) -> torch.nn.Module:
        """Move to the device; without master weights cast real floating tensors to the compute
        dtype (RoPE's complex cache stays complex)."""
        module.to(self.device)
        return module if self.cfg.under_autocast else _cast(module, self.dtype)

    def _rand(self, *shape, grad=True):
        return torch.randn(*shape, device=self.device, dtype=self.dtype, requires_grad=grad)

    def _time(self, curve, make, fwd, backward=True):
        if self.cfg.under_autocast:
            plain = fwd

            def fwd(*inputs):
                with torch.autocast(self.device.type, dtype=self.dtype):
                    return plain(*inputs)
        tf, tb = fwd_bwd_sample(self.clock, make, fwd, backward=backward, key=curve)
        return tf, tb, input_grad_sample(self.clock, make, fwd, key=curve) if backward else 0.0

    def measure(self, curve: str, x: int) -> tuple[float, float, float]:
        """One (forward, backward, input-gradient part of the backward) sample of ``curve`` at size
        ``x``; the last is 0 without a differentiable input (the embedding's token ids)."""
        b, tp = self.model.backbone, self.cfg.tp
        if curve in ("attention", "attention_packed"):
            docs = packed_docs(x, self.cfg.max_tokens) if curve == "attention_packed" else 1
            heads, kv, n = b.n_heads // tp, b.n_kv_heads // tp, x * docs
            meta = varlen_metadata(torch.arange(docs + 1, device=self.device) * x)
            return self._time(
                curve,
                lambda: (self._rand(1, n, heads, b.head_dim), self._rand(1, n, kv, b.head_dim), self._rand(1, n, kv, b.head_dim)),
                lambda q, k, v: self.attention(q, k, v, attention_masks=meta, enable_gqa=heads != kv),
            )
        if curve == "layer":
            meta = varlen_metadata(torch.tensor(layer_doc_bounds(x), device=self.device))
            pos = torch.arange(x, device=self.device)[None]
            return self._time(curve, lambda: (self._rand(1, x, b.dim),), lambda h: self.layer(h, meta, pos))
        if curve == "linear_layer":
            meta = varlen_metadata(torch.tensor(linear_doc_bounds(x, self.linear_doc_len)), self.device)
            return self._time(curve, lambda: (self._rand(1, x, b.dim),), lambda h: self.delta_net(h, meta))
        if curve == "linear_projections":
            dn = self.delta_net
            ins = (dn.in_proj_q, dn.in_proj_k, dn.in_proj_v, dn.in_proj_z, dn.in_proj_a, dn.in_proj_b)
            return self._time(
                curve,
                lambda: (self._rand(1, x, b.dim), self._rand(1, x, dn.out_proj.in_features)),
                lambda h, o: sum(p(h).sum() for p in ins) + dn.out_proj(o).sum(),
            )
        if curve == "embedding":
            return self._time(
                curve,
                lambda: (torch.randint(0, b.vocab_size // tp, (1, x), device=self.device),), lambda t: self.embedding(t)
            )
        if curve == "head":
            labels = torch.randint(0, b.vocab_size // tp, (x,), device=self.device)
            return self._time(
                curve,
                lambda: (self._rand(1, x, b.dim),),
                lambda h: F.cross_entropy(self.head(self.norm(h))[0].float(), labels, reduction="sum"),
            )
        enc = self.model.encoder
        if curve == "projector":
            return self._time(curve, lambda: (self._rand(x, enc.tokens_per_image, enc.merged_dim),), lambda f: self.projector(f))
        if curve == "encoder":
            side = enc.image_size // enc.patch_size
            return self._time(
                curve,
                lambda: (self._rand(x * enc.patches_per_image, enc.patch_dim, grad=not enc.frozen),),
                lambda p: self.encoder(p, ((side, side),) * x),
                backward=not enc.frozen,
            )
        raise KeyError(curve)

    def memory(self) -> dict[str, float]:
        """Saved activation bytes per token (per image), measured on the modules held in the compute
        dtype: with master weights, the weight copies each forward keeps are counted per micro-batch
        by the cost model instead (``CostModel.weight_copy_bytes``)."""
        if self.cfg.under_autocast:
            held = copy.copy(self)
            for name in ("layer", "embedding", "norm", "head", "projector"):
                if getattr(self, name) is not None:
                    setattr(held, name, _cast(copy.deepcopy(getattr(self, name)), self.dtype))
            held.cfg = replace(self.cfg, master_weights=False)
            return held.memory()
        b = self.model.backbone
        n = min(self.cfg.max_tokens, 1024)
        meta = varlen_metadata(torch.tensor([0, n], device=self.device))
        pos = torch.arange(n, device=self.device)[None]
        layer = saved_activation_bytes(lambda: self.layer(self._rand(1, n, b.dim), meta, pos), self.layer) / n
        emb = saved_activation_bytes(
            lambda: self.embedding(torch.randint(0, b.vocab_size // self.cfg.tp, (1, n), device=self.device)), self.embedding
        ) / n
        head_mod = torch.nn.Sequential(self.norm, self.head)
        head = saved_activation_bytes(lambda: head_mod(self._rand(1, n, b.dim)), head_mod) / n
        out = {"layer_bytes_per_token": layer, "embedding_bytes_per_token": emb, "head_bytes_per_token": head,
               "image_feature_bytes": 0.0, "projector_bytes_per_image": 0.0}
        enc = self.model.encoder
        if enc is not None:
            k = max(1, min(self.cfg.max_images, 8))
            out["projector_bytes_per_image"] = saved_activation_bytes(
                lambda: self.projector(self._rand(k, enc.tokens_per_image, enc.merged_dim)), self.projector
            ) / k
            out["image_feature_bytes"] = float(enc.tokens_per_image * enc.merged_dim * self._rand(1, grad=False).element_size())
        return out


def _cast(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    for t in [*module.parameters(), *module.buffers()]:
        if t.is_floating_point():
            t.data = t.data.to(dtype)
    return module


def _monotone(grid: list[int], values: list[float]) -> tuple[np.ndarray, float]:
    v = np.maximum(np.asarray(values, dtype=np.float64), 0.0)
    fitted = IsotonicRegression(increasing=True).fit_transform(np.asarray(grid, float), v)
    rel = np.abs(fitted - v) / np.maximum(v, 1e-12)
    return fitted, float(rel.max()) if len(rel) else 0.0


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {platform.processor() or platform.machine()}"


def _load_partial(partial: Path, header: dict) -> dict[str, list[list[float]]]:
    """Samples of an earlier run with the same settings; an unreadable file is reported and ignored."""
    if not partial.is_file():
        return {}
    try:
        saved = json.loads(partial.read_text())
        samples = saved["samples"] if saved.get("header") == header else {}
        if not all(isinstance(v, list) and all(isinstance(p, list) and len(p) == len(SAMPLE) for p in v) for v in samples.values()):
            raise ValueError(f"samples are not lists of ({', '.join(SAMPLE)}) triples")
        return samples
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        warnings.warn(f"profile resume file {partial} is corrupt ({e}); ignoring it and profiling from scratch", stacklevel=3)
        return {}


def _message_cost(model: ModelConfig, cfg: ProfileConfig, prof: "_Profiler") -> tuple[dict, str]:
    if not cfg.p2p:
        return {"latency_s": 2e-5, "bytes_per_s": 25e9}, "p2p not measured: assumed 20 us + bytes / 25 GB/s"
    from profiling.p2p import measure_p2p

    msg = measure_p2p(cfg.max_tokens * model.backbone.dim * prof._rand(1, grad=False).element_size())
    return msg, f"p2p measured with {msg.pop('backend')} between two local processes"


def run_profile(model: ModelConfig, cfg: ProfileConfig, out: str | Path, *, progress: bool = True) -> LatencyTable:
    """Profile ``model`` per ``cfg`` and write the latency table to ``out`` (resumable)."""
    out = Path(out)
    torch.set_num_threads(cfg.threads)
    retain_freed_memory()
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but CUDA is not available here")
    g = grids(cfg, model)
    header = {"sample": list(SAMPLE), "model": model.fingerprint(), "config": asdict(cfg), "grids": g, "device": _device_name(device)}
    partial = out.with_name(out.name + ".partial.json")
    samples = _load_partial(partial, header)
    tasks = measurement_tasks(model, cfg)
    prof = _Profiler(model, cfg)
    msg, p2p_note = _message_cost(model, cfg, prof)  # first: a machine too busy to measure fails before the long part
    done = min((len(samples.get(f"{c}:{x}", [])) for c, x in tasks), default=0)
    warm = cfg.warmup if done == 0 else 1
    what = f"profiling {model.name} ({len(tasks)} points, {warm} warm-up passes)"
    lines = progress and not sys.stderr.isatty()  # a log or a pipe: a line per pass, not a bar redrawn in place
    total, count = warm + cfg.repeats - done, iter(range(1, warm + cfg.repeats - done + 1))
    with tqdm(total=total, desc=what, disable=not progress or lines, unit=" passes") as bar:
        def passed() -> None:
            bar.update()
            n = next(count)
            if lines:
                print(f"{what}: pass {n}/{total}", file=sys.stderr, flush=True)

        for _ in range(warm):
            for curve, x in tasks:
                prof.measure(curve, x)
            passed()
        for k in range(done, cfg.repeats):
            for i in np.random.default_rng((cfg.seed, k)).permutation(len(tasks)):
                curve, x = tasks[i]
                samples.setdefault(f"{curve}:{x}", []).append(list(prof.measure(curve, x)))
            write_text_atomic(partial, json.dumps({"header": header, "samples": samples}))
            passed()
    points = {k: np.median(np.asarray(v[: cfg.repeats]), axis=0).tolist() for k, v in samples.items()}

    def series(curve: str, grid: list[int]) -> list[list[float]]:
        return [[points[f"{curve}:{x}"][k] for x in grid] for k in range(len(SAMPLE))]

    notes = []
    curves = {}

    def add(name: str, kind: str, grid: list[int], fwd: list[float], bwd: list[float], bwd_input: list[float] | None) -> None:
        f, df = _monotone(grid, fwd)
        b, db = _monotone(grid, bwd)
        i, di = _monotone(grid, bwd_input) if bwd_input is not None else (None, 0.0)
        note = f"{name}: isotonic adjustment up to {100 * max(df, db, di):.1f}%"
        if i is not None:
            cut = float(np.max((i - b) / np.maximum(b, 1e-12)))
            i = np.minimum(i, b)  # timed apart from the whole backward, the input gradient can exceed it a little
            note += f"; input gradient cut to the backward by up to {100 * cut:.1f}%" if cut > 0 else ""
        notes.append(note)
        curves[name] = Curve(kind, np.asarray(grid, float), f, b, i)

    per_doc = {
        x: [(p - o) / (packed_docs(x, cfg.max_tokens) - 1) for p, o in zip(points[f"attention_packed:{x}"], points[f"attention:{x}"])]
        for x in g["attention"]
    }
    add("attention", "seq_len", g["attention"], *([per_doc[x][k] for x in g["attention"]] for k in range(len(SAMPLE))))
    attention = curves["attention"]

    def layer_attention(x: int, k: int) -> float:
        """A layer's attention time in sample field ``k``: its backward for the input gradient too,
        as the cost model charges attention's ``I``, so that ``rest`` + attention gives the layer's."""
        docs = np.diff(layer_doc_bounds(x))
        return float(np.interp(docs, attention.grid, attention.fwd if k == 0 else attention.bwd).sum())

    rest = [[points[f"layer:{x}"][k] - layer_attention(x, k) for x in g["packed"]] for k in range(len(SAMPLE))]
    add("rest", "packed_len", g["packed"], *rest)
    notes.append(f"rest: a layer over {REST_DOC_LEN}-token documents minus their attention")
    if "linear" in g:
        lin = [[points[f"linear_layer:{x}"][k] - points[f"linear_projections:{x}"][k] for x in g["linear"]] for k in range(len(SAMPLE))]
        add("linear_attention", "chunked_len", g["linear"], *lin)
        notes.append(f"linear_attention: the model's Gated DeltaNet layer minus its projections, over documents of "
                     f"{linear_doc_len(model, cfg)} tokens")
    for name in ("embedding", "head"):
        add(name, "packed_len", g["packed"], *series(name, g["packed"]))
    if model.encoder is not None:
        for name in ("projector", "encoder"):
            fwd, bwd, bwd_input = series(name, g["images"])
            add(name, "images", g["images"], fwd, bwd, None if name == "encoder" and model.encoder.frozen else bwd_input)
    notes.append("bwd_input: the input-gradient part of each backward, timed alone (autograd.grad towards the inputs)")

    notes.append(p2p_note)
    notes.append("host: one copy to or from pinned host memory, measured with CUDA events" if device.type == "cuda"
                 else "host: none (a CPU has no link to offload activations over)")
    if cfg.tp > 1:
        notes.append(f"TP={cfg.tp}: one rank's shard was timed; TP collectives are not included")
    varlen = cfg.attention_backend == "flash" or (cfg.attention_backend == "auto" and cfg.dtype != "float32" and flash_attn_available(device))
    backend = "TorchTitan varlen" if varlen else "per-document SDPA"
    notes.append(f"attention backend: {backend}; threads: {cfg.threads}")
    table = LatencyTable(
        model=model,
        curves=curves,
        memory=prof.memory(),
        p2p=msg,
        device=_device_name(device),
        dtype=cfg.dtype,
        tp=cfg.tp,
        estimate=False,
        torch_version=torch.__version__,
        threads=cfg.threads,
        master_weights=cfg.under_autocast,
        notes=tuple(notes),
        host=measure_host_link(device),
    )
    table.save(out)
    partial.unlink(missing_ok=True)
    return table
