"""What every model family's mapping to pipetune's planning shapes shares: one value of a field all
layers must agree on, and a TorchTitan ``Decoder``'s backbone shapes."""

from __future__ import annotations

from torchtitan.models.common.decoder import Decoder

from pipetune.config.model import BackboneConfig, ConfigError


def uniform(values: list, what: str):
    if len(set(values)) != 1:
        raise ConfigError(f"{what} differs between layers ({sorted(set(values))}); pipetune's planning schema needs identical layers")
    return values[0]


def decoder_backbone(cfg: Decoder.Config) -> BackboneConfig:
    attn = [layer.attention for layer in cfg.layers]
    ffn = [layer.feed_forward for layer in cfg.layers]
    if any(getattr(layer, "moe", None) is not None or f is None for layer, f in zip(cfg.layers, ffn)):
        raise ConfigError("MoE layers are not in pipetune's planning schema (dense SwiGLU layers only)")
    n_heads = uniform([a.n_heads for a in attn], "n_heads")
    n_kv = uniform([a.n_kv_heads or a.n_heads for a in attn], "n_kv_heads")
    head_dim = uniform([a.head_dim or cfg.dim // a.n_heads for a in attn], "head_dim")
    if n_heads * head_dim != cfg.dim:
        raise ConfigError(
            f"n_heads * head_dim = {n_heads} * {head_dim} != dim = {cfg.dim}; pipetune's backbone schema has head_dim = dim / n_heads"
        )
    return BackboneConfig(
        n_layers=len(cfg.layers),
        dim=cfg.dim,
        ffn_dim=uniform([f.w1.out_features for f in ffn], "ffn hidden dim"),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        vocab_size=cfg.vocab_size,
        rope_theta=float(uniform([a.rope.theta for a in attn], "rope theta")),
        norm_eps=float(cfg.layers[0].attention_norm.eps),
        output_gate=bool(uniform([getattr(a, "o_gate", None) is not None for a in attn], "output gate")),
    )
