"""--fp8-stats N: what FP8 does to each linear's numbers, every N steps, and the run's worst linears.

For each FP8 linear and operand (x, W, dY) of the steps since the last report: the amax (the largest
|element| any of its casts saw), the scale its largest element was cast with (the smallest of its
blocks'), the fraction of its elements that saturated (|x s| beyond the largest value's rounding
interval: the clamp changed them)
and the fraction flushed to zero (nonzero, but below half the format's smallest subnormal once
scaled). Counted by every cast in the forward and backward of every micro-batch (fp8.Operands.cast),
summed over the ranks that saw other tokens or pieces (tp, dp x cp, pp), written into metrics.jsonl
beside the loss (a row's "fp8"); a mixture's experts are counted per projection over all experts.
The run's end names the linears whose operands flushed and saturated most (`closing`).
"""

from __future__ import annotations

import dataclasses

import torch

from nanohlat import comm
from nanohlat.beyond.fp8 import ROLES, STAT_FIELDS


def names(model_cfg) -> list[str]:
    """Every FP8 linear of the whole model, in one order on every rank (a row of the statistics each)."""
    out = []
    for i in range(model_cfg.n_layers):
        out += [f"layers.{i}.attn.{n}" for n in ("wq", "wk", "wv", "wo")]
        if model_cfg.is_moe_layer(i):
            out += [f"layers.{i}.mlp.experts.{n}" for n in ("gate", "up", "down")]
            if model_cfg.moe_shared_experts:
                out += [f"layers.{i}.mlp.shared_experts.{n}" for n in ("gate", "up", "down")]
        else:
            out += [f"layers.{i}.mlp.{n}" for n in ("gate", "up", "down")]
    return out


def _combine(table: torch.Tensor) -> torch.Tensor:
    """Several ranks' tables (ranks, rows, roles, fields) as one: the largest amax and smallest scale
    (stored as its inverse: a max too), the counts added."""
    return torch.cat([table[..., :2].amax(0), table[..., 2:].sum(0)], dim=-1)


class Figures:
    """The model's step figures with --fp8-stats (model.step_figures: a seam, docs/design.md 1): this rank's
    FP8 modules' statistics every `every` steps, and the figures of the part it stands in front of
    (`inner`: a mixture's, or None)."""

    def __init__(self, run, model_cfg, every: int, inner=None):
        self.run, self.every, self.inner = run, every, inner
        self.names = names(model_cfg)
        self.worst: dict = {}   # (linear, operand) -> (largest flushed fraction, largest saturated fraction) so far
        run.collecting = True

    def table(self, device) -> torch.Tensor:
        """This rank's statistics since the last report, a row per linear of the model (zeros for the others'),
        its own cleared."""
        t = torch.zeros(len(self.names), len(ROLES), STAT_FIELDS, device=device)
        for m in self.run.layers:
            s = m.stats
            if s.dim() == 2:   # a linear: (roles, fields)
                t[self.names.index(m.name)] = s.to(device)
            else:              # experts: (experts + 1 shared, projections, roles, fields)
                for j, proj in enumerate(("gate", "up", "down")):
                    t[self.names.index(f"{m.name}.{proj}")] = _combine(s[:-1, j].to(device))
                    shared = f"{m.name.replace('experts', 'shared_experts')}.{proj}"
                    if shared in self.names:
                        t[self.names.index(shared)] = s[-1, j].to(device)
            s.zero_()
        return t

    def metrics(self, mesh, device, step: int) -> dict:
        """The figures to log beside step `step`'s loss: the inner part's, and on a step that is a multiple
        of `every` the FP8 statistics, summed over every rank (every rank takes part, on those steps)."""
        out = self.inner.metrics(mesh, device, step) if self.inner is not None else {}
        report = step % self.every == 0
        self.run.collecting = (step + 1) % self.every == 0
        if not report:
            for m in self.run.layers:
                m.stats.zero_()
            return out
        t = self.table(device)
        for group in (mesh.tp_group, mesh.grad_group, mesh.pp_group):   # (no ledger: not the step's traffic)
            t = _combine(comm.all_gather(t.unsqueeze(0), dataclasses.replace(group, ledger=None)))
        rows = {}
        for name, per in zip(self.names, t.cpu().tolist()):
            rows[name] = {}
            for role, (amax, inverse, n, saturated, flushed) in zip(ROLES, per):
                if n == 0:
                    continue
                figure = {"amax": amax, "scale": 1 / inverse, "saturated": saturated / n, "flushed": flushed / n}
                rows[name][role] = figure
                old = self.worst.get((name, role), (0.0, 0.0))
                self.worst[(name, role)] = (max(old[0], figure["flushed"]), max(old[1], figure["saturated"]))
        out["fp8"] = {name: r for name, r in rows.items() if r}
        return out

    def closing(self) -> tuple[dict, str]:
        """(what summary.json adds, a line to print) at the run's end: the linears whose operand flushed
        most to zero and saturated most in any report, three each."""
        inner = self.inner.closing() if self.inner is not None else ({}, "")
        ranked = {}
        for k, what in ((0, "flushed"), (1, "saturated")):
            top = sorted(((v[k], name, role) for (name, role), v in self.worst.items() if v[k] > 0), reverse=True)[:3]
            ranked[what] = [{"linear": name, "operand": role, "fraction": f} for f, name, role in top]
        said = "; ".join(f"{what}: " + (", ".join(f"{r['linear']} {r['operand']} {r['fraction']:.2%}" for r in rs)
                                         or "none") for what, rs in ranked.items())
        return {**inner[0], "fp8_worst": ranked}, "\n".join(filter(None, [inner[1], f"fp8: the worst linears, {said}"]))
