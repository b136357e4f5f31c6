"""The optimizer's state out of its flat buffers, per parameter, and back in.

A checkpoint stores each parameter's weights and its optimizer state (master
weights, Adam moments) by name, so that another layout can cut them anew;
the optimizer holds them in flat buffers (optim.py:FlatAdamW), sharded under
ZeRO. fetch_buffers brings a rank's buffers to the host in one transfer,
export_weights and export_state cut them into parameters, import_state
fills the buffers back from full per-parameter tensors.
"""

from __future__ import annotations

import torch

from nanohlat.xla import to_host


def fetch_buffers(opt) -> list[dict]:
    """Each flat group's buffers (parameters, separate master if any, moments) on the host, whole:
    one transfer each (XLA: one graph); export_* cut them into parameters on the CPU copies."""
    return to_host([{"flat": g.gathered(), "master": None if g.master_is_params else g.master,
                     "exp_avg": g.exp_avg, "exp_avg_sq": g.exp_avg_sq} for g in opt.groups])


def export_weights(opt, host) -> dict:
    """{name: weight} of this rank's parameters, cut from the fetched flat buffers."""
    return {n: h["flat"][off:off + p.numel()].view_as(p).clone()
            for g, h in zip(opt.groups, host) for n, p, off in zip(g.names, g.params, g.offsets)}


def export_state(opt, host) -> dict:
    """The optimizer's state on this rank, per parameter: {name: {start, stop,
    master, exp_avg, exp_avg_sq}} where [start, stop) indexes this rank's
    tp-local parameter flattened (its `precision.Piece`s); ZeRO-1 ranks each
    export the piece of every parameter that falls in their shard. `host`: fetch_buffers(opt)."""
    out = {}
    for g, h in zip(opt.groups, host):
        master = h["flat"][g.start:g.stop] if h["master"] is None else h["master"]
        for p in g.pieces:
            a, b = p.start, p.stop
            out[p.name] = {"start": p.local_start, "stop": p.local_stop,
                           "master": master[a:b].float().clone(), "exp_avg": h["exp_avg"][a:b].clone(),
                           "exp_avg_sq": h["exp_avg_sq"][a:b].clone()}
    return out


def state_buffers(model) -> dict:
    """{name: tensor} of the model's persistent buffers: state that is no parameter, so no flat
    buffer holds it (a mixture's expert biases, moved after each step by the load: moe_figures.update_bias).
    Saved and loaded whole, as the model section's tensors that no rank splits."""
    params = {n for n, _ in model.named_parameters()}
    return {n: t for n, t in model.state_dict(keep_vars=True).items() if n not in params}


@torch.no_grad()
def import_state(opt, local_flat, step_count: int) -> None:
    """Fill the optimizer's (shards of) state from `local_flat(name, key)` -> the
    tp-local parameter's full flattened state (key: master | exp_avg | exp_avg_sq)."""
    opt.step_count.fill_(step_count)
    for g in opt.groups:
        g.load()                                       # (xla: the parameters' flat buffer, optim.FlatGroup)
        for key in ("master", "exp_avg", "exp_avg_sq"):
            dst = getattr(g, key)
            flat = g.flatten([local_flat(n, key) for n in g.names], torch.float32)
            dst.copy_(flat[g.start:g.stop].to(dst.dtype))
        g.store()
