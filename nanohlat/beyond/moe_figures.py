"""A mixture of experts' router figures in a step, what a run logs of them, and the bias that
balances without a loss (--moe-bias-rate), moved by them in each optimizer step: moe.py's Figures,
update_bias, tally and step_metrics, in a file of their own (moe.py imports them back).
"""

from __future__ import annotations

import dataclasses

import torch

from nanohlat import comm


class Figures:
    """A MoE model's router figures in one step, a row per sparse layer of the model: each training forward
    of the stage (a micro-batch, or an interleaved chunk of it) adds its layers' `tally`; `summed` adds them
    up over micro-batches, tp ranks (with SP each routed its share of the tokens; without, the same ones: the
    figures are ratios), the ranks of the gradient group and the pipeline stages. With --moe-bias-rate the
    optimizer step moves the biases by them (`move_biases`, its step hook: run/build.py); what a run logs
    of them is `metrics` (the model's step_figures: run/session.py reads it, and changes nothing)."""

    def __init__(self, cfg, model=None):
        self.cfg, self.total, self.reduced = cfg, None, None
        self.sparse = [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]   # the model's sparse layers
        # (--moe-bias-rate) this stage's sparse blocks by row, whose biases `step` updates
        self.blocks = {self.sparse.index(int(i)): b.mlp for i, b in model.layers.items()
                       if int(i) in self.sparse} if model is not None and cfg.moe_bias_rate else {}

    def after_forward(self, model, args, kwargs, out) -> None:
        """The stage's forward hook: its layers' figures, in their rows, added to the step's (not in
        evaluation or serving, which run without gradients)."""
        if not torch.is_grad_enabled():
            return
        ids = model.layer_ids if kwargs.get("layers") is None else list(kwargs["layers"])
        t = tally([model.layers[str(i)].mlp for i in ids])
        if t is None:
            return
        if t.shape[0] < len(self.sparse):   # a chunk of the model (pp): its rows in place, zeros for the others'
            where = torch.tensor([self.sparse.index(i) for i in ids if i in self.sparse], device=t.device)
            t = t.new_zeros(len(self.sparse), t.shape[1]).index_copy(0, where, t)
        self.total = t if self.total is None else self.total + t

    def summed(self, mesh, device) -> torch.Tensor:
        """The figures of the step's forwards so far, summed over every rank (every rank takes part), and
        a new sum begun."""
        total, self.total = self.total, None
        if total is None:   # a stage without sparse layers (--moe-every): zero rows, for the sum over pp
            total = torch.zeros(len(self.sparse), self.cfg.moe_experts + 4, device=device)
        for group in (mesh.tp_group, mesh.grad_group, mesh.pp_group):   # (no ledger: not the step's traffic)
            total = comm.all_reduce(total, dataclasses.replace(group, ledger=None))
        return total

    def move_biases(self, mesh, device, finite=None) -> None:
        """The optimizer's step hook (--moe-bias-rate): this stage's biases moved by the load of the whole
        global batch (`update_bias`), not when the step was not `finite` (skipped). The sum is kept for
        the step's `metrics`."""
        self.reduced = self.summed(mesh, device)
        for row, block in self.blocks.items():
            update_bias(block.expert_bias, self.reduced[row, :self.cfg.moe_experts], self.cfg.moe_bias_rate, finite)

    def metrics(self, mesh, device, step: int = 0) -> dict:
        """What a run logs of step `step` (step_metrics), summed over every rank; every rank takes part.
        After the step hook, its sum (the same figures, already summed)."""
        total, self.reduced = (self.reduced if self.reduced is not None else self.summed(mesh, device)), None
        return step_metrics(total.cpu(), self.cfg.moe_aux_coef, self.cfg.moe_z_coef)

    def closing(self) -> tuple[dict, str]:
        """What the run's end adds to summary.json and prints of these figures: nothing (the log has them)."""
        return {}, ""


@torch.no_grad()
def update_bias(bias, load, rate: float, finite=None) -> None:
    """DeepSeek-V3's balancing without an auxiliary loss: after each step, each expert's bias moves
    by a fixed `rate` towards balance: up if it got fewer than its share of the step's routing
    choices (the mean over experts), down if more, not at all if exactly its share. `load`: the
    choices per expert of the whole global batch in this layer (Figures.step sums them over tp,
    dp x cp (with --ep in it) and pp), the same on every rank, so every rank and every layout moves
    the bias alike. The comparison is made on the counts, integers (exact in fp32 while one step's
    count stays under 2^24), as sum - E x load_e: no division to round. Without tp's sequence
    parallelism each tp rank counts the same tokens: every count x tp, which leaves every sign as it
    is. `finite` (the optimizer's, on the device): a skipped step moves nothing (0 x the step)."""
    step = rate * torch.sign(load.sum() - load.numel() * load)
    bias.add_(step if finite is None else step * finite.float())


def tally(blocks) -> torch.Tensor | None:
    """One micro-batch's figures to log, per MoE layer (rows): its tokens per
    expert (E columns), then the sums over sequences of balance and z, the
    sequence count and the dropped fraction times it. Summed over micro-batches and dp
    ranks, `step_metrics` turns them into the logged means."""
    moes = [mlp for mlp in blocks if hasattr(mlp, "load")]   # the moe.MoE blocks (a dense MLP keeps no load)
    if not moes:
        return None
    # every layer's at once, a handful of ops however many layers (this runs after every forward)
    load, dropped = (torch.stack(t) for t in zip(*(m.load for m in moes)))           # (layers, E), (layers,)
    balance, z = (torch.stack([t.detach() for t in ts]) for ts in zip(*(m.losses for m in moes)))   # (layers, B)
    n = torch.full_like(balance[:, 0], balance.shape[1])                             # sequences, per layer
    return torch.cat([load, balance.sum(1, keepdim=True), z.sum(1, keepdim=True),
                      n.unsqueeze(1), (dropped * n).unsqueeze(1)], dim=1)


def step_metrics(total: torch.Tensor, aux_coef: float, z_coef: float) -> dict:
    """The summed tally of a step (layers x (E + 4)) -> the logged figures:
    moe_router_loss (what the router losses add to the objective: per sequence, summed over layers,
    with their coefficients), moe_balance, moe_z (mean per sequence and layer, without coefficients),
    moe_load_max (max over layers of the busiest expert's tokens / the mean expert's), moe_load_cv (the
    coefficient of variation of the tokens per expert, std / mean, mean over layers: 0 when balanced) and moe_dropped
    (the share of choices dropped, mean over layers)."""
    load, balance, z, seqs, dropped = total[:, :-4], total[:, -4], total[:, -3], total[:, -2], total[:, -1]
    return {"moe_router_loss": float(((aux_coef * balance + z_coef * z) / seqs).sum()),
            "moe_balance": float((balance / seqs).mean()), "moe_z": float((z / seqs).mean()),
            "moe_load_max": float((load.max(dim=1).values / load.mean(dim=1)).max()),
            "moe_load_cv": float((load.std(dim=1, unbiased=False) / load.mean(dim=1)).mean()),
            "moe_dropped": float((dropped / seqs).mean())}
