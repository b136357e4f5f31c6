"""FastFlatAdamW.attach (tools/fast_adamw.py): where FlatAdamW's per-parameter hook would only add the
gradient into its group's fp32 buffer, `p.grad` is the parameter's view of that buffer and autograd
adds into it in place: the same buffers bit for bit, micro-batch after micro-batch and step after
step; the hooks stay where they do more (bf16 parameters, ZeRO-2's shards)."""

from __future__ import annotations

import pytest
import torch

from nanohlat import comm, mesh as meshlib, recipe
from nanohlat.device import get_device
from nanohlat.optim import FlatAdamW
from nanohlat.run.build import build
from nanohlat.tools import fast_adamw


def built(argv, hooks: bool = False, monkeypatch=None):
    """(model, runner, opt, tcfg, tokens, targets) of one process; hooks: FlatAdamW's hooks even where views could go."""
    cfg, tcfg = recipe.parse_args(["--preset", "tiny", "--n-layers", "2", "--batch-size", "4"] + argv)
    if hooks:
        monkeypatch.setattr(fast_adamw.FastFlatAdamW, "attach", FlatAdamW.attach)
    model, runner, opt = build(cfg, tcfg, meshlib.Mesh(1, 1, 1, ledger=comm.CommLedger()), get_device("cpu"))
    if hooks:
        monkeypatch.undo()
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, cfg.vocab_size, (tcfg.batch_size, tcfg.seq_len + 1), generator=g)
    mb = tcfg.batch_size // tcfg.microbatches
    tokens = list(batch[:, :-1].split(mb))
    targets = list(batch[:, 1:].split(mb))
    return model, runner, opt, tcfg, tokens, targets


def hooks_on(model) -> int:
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def test_fp32_gradients_are_views_of_the_buffers_and_no_hook_is_left():
    model, _, opt, *_ = built([])
    assert isinstance(opt, fast_adamw.FastFlatAdamW) and hooks_on(model) == 0
    for g in opt.groups:
        for p, off in zip(g.params, g.offsets):
            assert p.grad.data_ptr() == g.grad[off:].data_ptr() and p.grad.shape == p.shape
    opt.zero_grad()
    assert all(p.grad is not None and p.grad.data_ptr() for p in model.parameters())


@pytest.mark.parametrize("argv", [["--microbatches", "2"], ["--preset", "moe", "--n-layers", "2"]])
def test_views_sum_the_same_bits_as_the_hooks(argv, monkeypatch):
    """Two micro-batches a step (the second added to the first in the buffer), three steps."""
    ours = built(argv)
    hooked = built(argv, hooks=True, monkeypatch=monkeypatch)
    assert hooks_on(ours[0]) == 0 and hooks_on(hooked[0]) == sum(1 for _ in hooked[0].parameters())
    for step in range(3):
        for model, runner, opt, tcfg, tokens, targets in (ours, hooked):
            opt.zero_grad()
            runner.run(tokens, targets, 1.0 / (tcfg.batch_size * tcfg.seq_len))
        for a, b in zip(ours[2].groups, hooked[2].groups):
            assert torch.equal(a.grad, b.grad) and a.grad.abs().sum() > 0
        for model, runner, opt, tcfg, *_ in (ours, hooked):
            opt.step(tcfg.lr)
        for a, b in zip(ours[0].parameters(), hooked[0].parameters()):
            assert torch.equal(a, b)


@pytest.mark.parametrize("argv", [["--precision", "bf16-sr"], ["--zero", "2"]])
def test_the_hooks_stay_where_they_do_more_than_add(argv):
    """bf16 parameters (the gradient is bf16, the buffer fp32); ZeRO-2 (each rank keeps a shard)."""
    model, _, opt, tcfg, *_ = built(argv)
    assert opt.views == [] and hooks_on(model) == sum(1 for _ in model.parameters())
    assert not fast_adamw.grad_views(tcfg, 1)


def test_the_plans_rule_says_where_views_go():
    """fast_adamw.grad_views, the plan's rule from the recipe alone, agrees with what attach did above, and
    keeps the hooks for a bucket started in the backward (dp 2 with overlap) and on XLA."""
    _, _, opt, tcfg, *_ = built([])
    assert opt.views and fast_adamw.grad_views(tcfg, 1)
    assert not fast_adamw.grad_views(tcfg, 2) and tcfg.overlap_grad_reduce
    _, xla = recipe.parse_args(["--preset", "tiny", "--device", "xla", "--compile"])
    _, no_overlap = recipe.parse_args(["--preset", "tiny", "--no-overlap-grad-reduce"])
    assert not fast_adamw.grad_views(xla, 1) and fast_adamw.grad_views(no_overlap, 2)
