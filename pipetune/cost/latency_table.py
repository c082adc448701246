"""The latency table: measured (or estimated) per-component latency curves of one model on one device.

File format (JSON, ``format = "pipetune.latency_table"``, ``version = 1``)::

    {"format", "version", "estimate": bool, "device", "dtype", "torch", "threads", "tp",
     "model": ModelConfig dict, "model_fingerprint",
     "curves": {name: {"x": what the grid counts, "grid": [...], "fwd": [...], "bwd": [...],
                       "bwd_input": [...]}},  # optional: the input-gradient part of bwd, timed
                                          # alone or fitted by online calibration (a split
                                          # backward's I; see cost_model)
     "memory": {"layer_bytes_per_token", "embedding_bytes_per_token", "head_bytes_per_token",
                "image_feature_bytes", "projector_bytes_per_image"},
     "p2p": {"latency_s", "bytes_per_s"},
     "scales": {component: factor},       # from calibration; 1.0 when absent
     "overhead": {"fwd_s", "bwd_s"},      # fixed cost of one stage forward / backward call
                                          # (from calibration; 0 when absent)
     "variability": {kind: {"log_var", "log_var_s", "min_s"}},  # optional: spread of measured
                                          # action times, kind in stage / encoder / p2p (from
                                          # calibration; absent = no jitter; see cost.variability)
     "contention": kappa,                 # optional: work slows by 1 + kappa while another rank
                                          # is busy (from calibration on runtime timelines; 0 when
                                          # absent; see simulate.contention)
     "master_weights": true,              # optional: timed with float32 weights under autocast to
                                          # dtype (a job without FSDP); its forwards keep weight
                                          # copies (CostModel.weight_copy_bytes); absent = false
     "host": {"latency_s", "bytes_per_s"},  # optional: one copy between device and pinned host
                                          # memory (activation offload; profiled on CUDA, from
                                          # the hardware preset in estimates); absent = no offload
     "notes": [...]}

Curves (seconds per call, per layer where it says so):

| name        | x          | meaning                                                         |
|-------------|------------|-----------------------------------------------------------------|
| attention   | seq_len    | one layer's attention over one document of that length           |
| rest        | packed_len | one layer minus its attention, over a packed sequence            |
| embedding   | packed_len | token embedding (first stage)                                    |
| head        | packed_len | final norm + output head + loss (last stage)                     |
| projector   | images     | MLP projector over that many images' features (first stage)      |
| encoder     | images     | the vision encoder over that many images (bwd 0 when frozen)     |
| linear_attention | chunked_len | one linear-attention layer's token mixing without its projections |
|             |            | (convolutions, gates, chunked gated delta rule, gated norm) over a |
|             |            | packed sequence whose documents are padded to whole chunks         |

``linear_attention`` is present exactly when the model has linear-attention layers
(``BackboneConfig.linear_attention``); tables of other models, including those written before the
curve existed, load unchanged.

Grids are strictly increasing and positive; values finite, >= 0, non-decreasing in x and not zero
everywhere (except a frozen encoder's backward, and ``bwd_input``). A curve's ``bwd_input``, where
present, is at most its ``bwd`` at each point up to ``INPUT_GRAD_TOLERANCE`` (the two are timed
apart, so a measured input gradient can exceed the whole backward a little) and is cut to ``bwd``
on loading; tables without it (estimates, older profiles) load unchanged and the cost model falls
back to its fixed shares. A loader that finds anything else, or a field of the wrong JSON type,
refuses the file and says what and where.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipetune.config.model import ModelConfig
from pipetune.cost.variability import KINDS, Spread, Variability
from pipetune.files import write_text_atomic

FORMAT = "pipetune.latency_table"
VERSION = 1
CURVES = {
    "attention": "seq_len",
    "rest": "packed_len",
    "embedding": "packed_len",
    "head": "packed_len",
    "projector": "images",
    "encoder": "images",
    "linear_attention": "chunked_len",
}
TEXT_ONLY_OPTIONAL = ("projector", "encoder")
INPUT_GRAD_TOLERANCE = 0.05  # relative: how far a curve's bwd_input may exceed its bwd
PROFILE_HINT = "python -m profiling.prepare_job --config <job> --out <dir> (or pipetune profile --model <model> --out <file>)"
OVERHEAD_KEYS = ("fwd_s", "bwd_s")
MEMORY_KEYS = (
    "layer_bytes_per_token",
    "embedding_bytes_per_token",
    "head_bytes_per_token",
    "image_feature_bytes",
    "projector_bytes_per_image",
)


class LatencyTableError(ValueError):
    """A latency table that must not be planned on; the message says what is wrong."""


@dataclass(frozen=True)
class Curve:
    """Latency of one component as a function of one size (``grid``), forward and backward, and
    the backward's input-gradient part where it was profiled or fitted online (``bwd_input``, else
    None)."""

    x: str
    grid: np.ndarray
    fwd: np.ndarray
    bwd: np.ndarray
    bwd_input: np.ndarray | None = None

    def to_dict(self) -> dict:
        out = {"x": self.x, "grid": self.grid.tolist(), "fwd": self.fwd.tolist(), "bwd": self.bwd.tolist()}
        return out | ({"bwd_input": self.bwd_input.tolist()} if self.bwd_input is not None else {})


@dataclass(frozen=True)
class LatencyTable:
    model: ModelConfig
    curves: dict[str, Curve]
    memory: dict[str, float]
    p2p: dict[str, float]
    device: str
    dtype: str
    tp: int = 1
    estimate: bool = False
    torch_version: str = ""
    threads: int = 0
    scales: dict[str, float] = field(default_factory=dict)
    overhead: dict[str, float] = field(default_factory=dict)
    variability: Variability | None = None
    contention: float = 0.0
    master_weights: bool = False
    notes: tuple[str, ...] = ()
    host: dict[str, float] | None = None

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "estimate": self.estimate,
            "device": self.device,
            "dtype": self.dtype,
            "torch": self.torch_version,
            "threads": self.threads,
            "tp": self.tp,
            "model": self.model.to_dict(),
            "model_fingerprint": self.model.fingerprint(),
            "curves": {k: c.to_dict() for k, c in self.curves.items()},
            "memory": dict(self.memory),
            "p2p": dict(self.p2p),
            "scales": dict(self.scales),
            "overhead": dict(self.overhead),
            **({"variability": self.variability.to_dict()} if self.variability is not None else {}),
            **({"contention": self.contention} if self.contention else {}),
            **({"master_weights": True} if self.master_weights else {}),
            **({"host": dict(self.host)} if self.host is not None else {}),
            "notes": list(self.notes),
        }

    def save(self, path: str | Path) -> Path:
        return write_text_atomic(path, json.dumps(self.to_dict(), indent=1))

    @property
    def device_type(self) -> str:
        """The device type the table was made for: profiled CPU tables name ``cpu: <processor>``
        (``profiling.profile_layers``); profiled GPU tables name the GPU and analytical estimates the
        GPU they model, both CUDA."""
        return "cpu" if self.device.split(":")[0].strip().lower() == "cpu" else "cuda"

    def scale(self, component: str) -> float:
        return float(self.scales.get(component, 1.0))

    def fixed(self, which: str) -> float:
        """Fixed seconds of one stage ``fwd`` or ``bwd`` call (runtime overhead found by calibration)."""
        return float(self.overhead.get(f"{which}_s", 0.0))


def load_latency_table(path: str | Path, *, model: ModelConfig | None = None, tp: int | None = None) -> LatencyTable:
    """Read and validate a table; with ``model``/``tp`` also check that it belongs to this job."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise LatencyTableError(f"latency table {path} does not exist (write one with `pipetune profile`)") from None
    except json.JSONDecodeError as e:
        raise LatencyTableError(f"latency table {path}: not valid JSON ({e})") from None
    table = table_from_dict(raw, where=str(path))
    if model is not None and model.backbone.linear_attention is not None and table.model.backbone.linear_attention is None:
        raise LatencyTableError(
            f"latency table {path} prices every layer of {table.model.name!r} as full attention, but the job's model "
            f"{model.name!r} has linear-attention layers {list(model.backbone.linear_layers)}: re-profile it for this model "
            f"({PROFILE_HINT})"
        )
    if model is not None and table.model.fingerprint() != model.fingerprint():
        raise LatencyTableError(
            f"latency table {path} was profiled for model {table.model.name!r} "
            f"(fingerprint {table.model.fingerprint()}), but the job uses {model.name!r} ({model.fingerprint()}); "
            "profile this model or pass the matching table"
        )
    if tp is not None and table.tp != tp:
        raise LatencyTableError(f"latency table {path} was profiled with TP={table.tp}, but the job uses TP={tp}: profile one "
                                f"for TP={tp} (python -m profiling.prepare_job ... --tp {tp})")
    return table


def table_from_dict(raw: dict, *, where: str = "latency table") -> LatencyTable:
    def fail(msg: str):
        raise LatencyTableError(f"{where}: {msg}")

    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        fail(f"not a pipetune latency table (format field is {raw.get('format') if isinstance(raw, dict) else None!r})")
    if raw.get("version") != VERSION:
        fail(f"version {raw.get('version')!r} is not supported (this pipetune reads version {VERSION})")
    for key in ("model", "curves", "memory", "p2p", "device", "dtype"):
        if key not in raw:
            fail(f"missing field {key!r}")
    for key, kind in (("curves", dict), ("memory", dict), ("p2p", dict), ("host", dict), ("scales", dict), ("overhead", dict),
                      ("variability", dict), ("device", str), ("dtype", str), ("torch", str), ("estimate", bool), ("master_weights", bool), ("notes", list)):
        if key in raw and not isinstance(raw[key], kind):
            fail(f"field {key!r} must be a JSON {_JSON_KIND[kind]}, got {raw[key]!r}")
    for key in ("tp", "threads"):
        v = raw.get(key, 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < (1 if key == "tp" else 0):
            fail(f"{key} must be a {'positive' if key == 'tp' else 'non-negative'} integer, got {v!r}")
    try:
        model = ModelConfig.from_dict(raw["model"])
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        fail(f"model config is malformed ({e})")
    if raw.get("model_fingerprint") not in (None, model.fingerprint()):
        fail("model_fingerprint does not match its model config (the file was edited or is corrupt)")
    curves = {}
    linear = model.backbone.linear_attention is not None
    needed = [n for n in CURVES if not ((model.encoder is None and n in TEXT_ONLY_OPTIONAL) or (n == "linear_attention" and not linear))]
    if not linear and "linear_attention" in raw["curves"]:
        fail(f"curve 'linear_attention' given, but model {model.name!r} has no linear-attention layers")
    for name, x in CURVES.items():
        if name not in raw["curves"]:
            if name not in needed:
                continue
            if name == "linear_attention":
                fail(f"missing curve 'linear_attention': model {model.name!r} has linear-attention layers "
                     f"{list(model.backbone.linear_layers)}; re-profile it ({PROFILE_HINT})")
            fail(f"missing curve {name!r} (needed: {sorted(needed)})")
        curves[name] = _curve(raw["curves"][name], name, x, fail)
        frozen = name == "encoder" and model.encoder.frozen
        for which in ("fwd",) if frozen else ("fwd", "bwd"):
            if getattr(curves[name], which)[-1] <= 0:
                fail(f"curve {name!r}.{which} is zero everywhere: this component would cost nothing; re-profile the model")
    memory = {key: _number(raw["memory"], key, "memory", fail) for key in MEMORY_KEYS}
    p2p = {key: _number(raw["p2p"], key, "p2p", fail) for key in ("latency_s", "bytes_per_s")}
    if p2p["bytes_per_s"] == 0:
        fail("p2p.bytes_per_s must be a finite positive number, got 0")
    scales = raw.get("scales", {})
    bad = [k for k, v in scales.items() if k not in CURVES or not (_is_number(v) and v > 0)]
    if bad:
        fail(f"scales {bad} are not known components with a positive factor")
    scales = {k: float(v) for k, v in scales.items()}
    overhead = {k: _number(raw.get("overhead", {}), k, "overhead", fail) for k in raw.get("overhead", {})}
    if any(k not in OVERHEAD_KEYS for k in overhead):
        fail(f"overhead must hold {OVERHEAD_KEYS} as finite numbers >= 0, got {overhead}")
    host = {key: _number(raw["host"], key, "host", fail) for key in ("latency_s", "bytes_per_s")} if "host" in raw else None
    if host is not None and host["bytes_per_s"] == 0:
        fail("host.bytes_per_s must be a finite positive number, got 0")
    contention = raw.get("contention", 0.0)
    if not (_is_number(contention) and contention >= 0):
        fail(f"contention must be a finite number >= 0 (the slow-down of work while another rank is busy), got {contention!r}")
    return LatencyTable(
        model=model,
        curves=curves,
        memory=memory,
        p2p=p2p,
        device=str(raw["device"]),
        dtype=str(raw["dtype"]),
        tp=raw.get("tp", 1),
        estimate=raw.get("estimate", False),
        torch_version=raw.get("torch", ""),
        threads=raw.get("threads", 0),
        scales=scales,
        overhead=overhead,
        variability=_variability(raw["variability"], fail) if "variability" in raw else None,
        contention=float(contention),
        master_weights=raw.get("master_weights", False),
        notes=tuple(str(n) for n in raw.get("notes", ())),
        host=host,
    )


def _variability(raw: dict, fail) -> Variability:
    unknown = sorted(set(raw) - set(KINDS))
    if unknown:
        fail(f"variability has unknown action kinds {unknown} (known: {list(KINDS)})")
    spreads = {}
    for kind, section in raw.items():
        where = f"variability.{kind}"
        if not isinstance(section, dict) or set(section) - {"log_var", "log_var_s", "min_s"}:
            fail(f"{where} must be an object of log_var, log_var_s and min_s, got {section!r}")
        values = {key: _number(section, key, where, fail) for key in section}
        if values.get("log_var_s", 0) > 0 and values.get("min_s", 0) <= 0:
            fail(f"{where}.min_s must be > 0 when log_var_s > 0, got {section.get('min_s')!r}")
        spreads[kind] = Spread(**values)
    return Variability(**spreads)


_JSON_KIND = {dict: "object", str: "string", bool: "true/false", list: "list"}


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _number(section: dict, key: str, where: str, fail) -> float:
    v = section.get(key)
    if not _is_number(v) or v < 0:
        fail(f"{where}.{key} must be a finite number >= 0, got {v!r}")
    return float(v)


def _curve(raw, name: str, x: str, fail) -> Curve:
    if not isinstance(raw, dict):
        fail(f"curve {name!r} is not an object")
    if raw.get("x") != x:
        fail(f"curve {name!r} must be over {x!r}, got {raw.get('x')!r}")
    arrays = {}
    for key in ("grid", "fwd", "bwd", "bwd_input"):
        if key == "bwd_input" and key not in raw:
            continue
        v = raw.get(key)
        if not isinstance(v, list) or not v:
            fail(f"curve {name!r} has no {key} values (missing grid)")
        if not all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in v):  # NaN/inf: refused below
            fail(f"curve {name!r}.{key} must be a flat list of numbers, got {v!r}")
        arrays[key] = np.asarray(v, dtype=np.float64)
    g = arrays["grid"]
    if not (len(arrays["fwd"]) == len(arrays["bwd"]) == len(g)):
        fail(f"curve {name!r}: grid has {len(g)} points but fwd/bwd have {len(arrays['fwd'])}/{len(arrays['bwd'])}")
    if "bwd_input" in arrays and len(arrays["bwd_input"]) != len(g):
        fail(f"curve {name!r}: grid has {len(g)} points but bwd_input has {len(arrays['bwd_input'])}")
    if not np.isfinite(g).all() or (g <= 0).any() or (np.diff(g) <= 0).any():
        fail(f"curve {name!r}: grid must be positive and strictly increasing, got {g.tolist()}")
    for key in [k for k in arrays if k != "grid"]:
        v = arrays[key]
        if not np.isfinite(v).all():
            fail(f"curve {name!r}.{key} has non-finite values")
        if (v < 0).any():
            i = int(np.argmax(v < 0))
            fail(f"curve {name!r}.{key} is negative at {x}={g[i]:g} ({v[i]:g} s)")
        if (np.diff(v) < 0).any():
            i = int(np.argmax(np.diff(v) < 0))
            fail(
                f"curve {name!r}.{key} is not monotonic: {v[i]:g} s at {x}={g[i]:g} but {v[i + 1]:g} s at "
                f"{x}={g[i + 1]:g}"
            )
    bwd_input = arrays.get("bwd_input")
    if bwd_input is not None:
        over = bwd_input > arrays["bwd"] * (1 + INPUT_GRAD_TOLERANCE)
        if over.any():
            i = int(np.argmax(over))
            fail(f"curve {name!r}.bwd_input exceeds its bwd at {x}={g[i]:g} ({bwd_input[i]:g} s > {arrays['bwd'][i]:g} s, "
                 f"more than {100 * INPUT_GRAD_TOLERANCE:g} % over): the input gradient is a part of the backward")
        bwd_input = np.minimum(bwd_input, arrays["bwd"])
    return Curve(x=x, grid=g, fwd=arrays["fwd"], bwd=arrays["bwd"], bwd_input=bwd_input)
