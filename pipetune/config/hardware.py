"""Accelerator figures for the analytical latency presets (``pipetune/presets/hardware/*.toml``)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from pipetune.config.model import ConfigError, check_field_types


@dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    """Published peaks plus assumed efficiencies; see ``pipetune.cost.analytical`` for their use.

    ``gemm_half_tokens``: tokens per GEMM (at TP 1) at which a GEMM reaches half its large-size
    rate; ``attention_half_len``: the same for one document's attention. Both describe the
    under-utilisation of small work (PipeTune Fig. 10). ``host_*``: a copy between device and
    pinned host memory, what an activation offload costs each way.
    """

    name: str
    peak_flops: float
    hbm_bytes_per_s: float
    memory_bytes: float
    gemm_efficiency: float
    attention_fwd_efficiency: float
    attention_bwd_efficiency: float
    gemm_half_tokens: float
    attention_half_len: float
    kernel_launch_s: float
    tp_bytes_per_s: float
    tp_latency_s: float
    p2p_bytes_per_s: float
    p2p_latency_s: float
    host_bytes_per_s: float = 25e9  # one way, pinned host memory over PCIe Gen4 x16 (Gen5 hosts: about twice)
    host_latency_s: float = 10e-6

    def __post_init__(self) -> None:
        check_field_types(self, "hardware")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name != "name" and not v > 0:
                raise ConfigError(f"hardware {self.name!r}: {f.name} must be a positive number, got {v!r}")
        for f in ("gemm_efficiency", "attention_fwd_efficiency", "attention_bwd_efficiency"):
            if getattr(self, f) > 1:
                raise ConfigError(f"hardware {self.name!r}: {f} is a fraction of peak and must be <= 1")
