"""Serving with the model (sample.py, generate.py): the bytes of the KV cache,
whole and per tp rank, and the section of the plan that prints them."""

from __future__ import annotations

from nanohlat.recipe import ModelConfig, TrainConfig
from nanohlat.plan.fmt import fmt_bytes, table
from nanohlat.plan.params import dtype_bytes, stage_param_counts


def kv_cache_bytes(cfg: ModelConfig, tokens: int, itemsize: int, kv_heads: int | None = None) -> int:
    """Keys and values of `tokens` cached tokens over all layers: per token and
    layer 2 (k and v) x kv heads x head dim x itemsize bytes (generate.py's cache)."""
    kv = cfg.n_kv_heads if kv_heads is None else kv_heads
    return tokens * cfg.n_layers * 2 * kv * cfg.head_dim * itemsize


def kv_cache_section(cfg: ModelConfig, tcfg: TrainConfig) -> list[str]:
    """Serving with this model (sample.py, generate.py): the KV cache for a
    context of --seq-len tokens, per sequence and per batch, whole and per tp rank."""
    tp, itemsize, T = tcfg.tp, dtype_bytes(tcfg.precision), tcfg.seq_len
    kv_local = cfg.kv_heads_per_rank(tp)
    per_layer = kv_cache_bytes(cfg, 1, itemsize) // cfg.n_layers
    lines = ["", f"KV cache when serving (generate.py), {itemsize}-byte values: per token per layer 2 (k, v) x "
             f"{cfg.n_kv_heads} kv heads x {cfg.head_dim} head dim x {itemsize} B = {fmt_bytes(per_layer)}; x {cfg.n_layers} "
             f"layers = {fmt_bytes(kv_cache_bytes(cfg, 1, itemsize))} per token",
         f"  a tp rank caches its {kv_local} kv head(s)" + (" (replicas: tp > kv heads)" if tp > cfg.n_kv_heads else "")
         + f"; weights per tp rank {fmt_bytes(stage_param_counts(cfg, tp, 1, 0)['total'] * itemsize)}"]
    rows = []
    for batch in (1, 8, 64):
        whole = kv_cache_bytes(cfg, batch * T, itemsize)
        rows.append([batch, f"{batch * T:,}", fmt_bytes(whole), fmt_bytes(kv_cache_bytes(cfg, batch * T, itemsize, kv_local))])
    lines += table(["batch", f"tokens at context {T}", "whole model", f"per tp rank (tp {tp})"], rows)
    if cfg.n_kv_heads < cfg.n_heads:
        lines.append(f"  grouped-query attention: {cfg.n_kv_heads} kv heads for {cfg.n_heads} query heads; with one kv "
                 f"head per query head the cache would be {cfg.n_heads // cfg.n_kv_heads}x larger "
                 f"({fmt_bytes(kv_cache_bytes(cfg, T, itemsize, cfg.n_heads))} per sequence)")
    return lines
