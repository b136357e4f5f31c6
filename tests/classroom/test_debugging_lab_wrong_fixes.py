"""The lab's `check` against planted wrong fixes: each fails, with a message a student can act on.

A wrong fix hides what the bug's first layout shows and leaves the bug (or a
new one) elsewhere: the printed loss rescaled while the gradients stay
doubled, a special case for the degree that shows it, a constant where the
vocabulary's size belongs, a sum over tp for groups that need none, the
step count restored from the wrong number. Each is planted into the bug's
code (as text, in the lab's workers: lab_workers.Job.texts) and graded by
lab.grade exactly as `check bugN` grades a copy; the test asserts that it
fails and that the verdict names the case and figure that caught it
(`catches`). The first eight are the ones a session found `check` accepting
(issue 58); the rest are the lab's own.

They are graded together with the reference fixes and the planted bugs
(lab_grading.graded, shared with tests/classroom/test_debugging_lab.py: one set of worker pools, every
one-process reference run once): a wrong fix's cases stop at its first
failure.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import pytest

from conftest import ROOT
from nanohlat.classroom import lab, lab_bugs


@dataclass(frozen=True)
class WrongFix:
    n: int             # the bug it claims to fix
    what: str          # the fix, in a line
    changes: tuple     # (file, old, new) applied on top of the planted bug (keep=True) or of the reference
    catches: str       # a regex the verdict must match: the case and the figure that caught it
    keep: bool = True  # the bug's plant stays (the fix is elsewhere)


def texts(fix: WrongFix) -> dict:
    bug = lab_bugs.BY_N[fix.n]
    plant = [(bug.file, bug.old, bug.new)] if fix.keep else []
    return lab.patched(ROOT, plant + list(fix.changes))


TRAIN_END = "if session.end_step(step + 1, loss, norm, finite, lr):"
SCALE = "runner.run(tokens, targets, 1.0 / tokens_per_step)"
MASK = '    logits = logits.masked_fill(ids >= vocab_size, float("-inf"))\n'
SR = "master[p.start:p.stop].copy_(stochastic_round_to_bf16(w[p.start:p.stop], noise=noise))"
NOISE = "noise = rounding_noise(mix64(key ^ p.name_key), index)"
EP_DP = "    return [[r(d, p, t) for d in range(j, dp, ep)] for p in range(pp) for t in range(tp) for j in range(ep)]\n"
ROTARY = "return self.positions(t)[self.group.rank]"
GATHER = "comm.all_gather(shard[a:b].contiguous(), group).view(group.size, b - a)"

WRONG_FIXES = [
    # -- the eight issue 58 found passing --
    WrongFix(1, "the printed loss and grad norm divided by dp, the gradients still dp times too large",
             (("train.py", TRAIN_END, "if session.end_step(step + 1, loss / mesh.dp, norm / mesh.dp, finite, lr):"),),
             r"--grad-clip 1\.5` \(a clip that does not bite\): after the last step parameter \S+ differs"),
    WrongFix(1, "a special case: the loss scaled by 0.5 at dp 2",
             (("train.py", "1.0 / (tokens_per_step // mesh.dp)", "(0.5 if mesh.dp == 2 else 1.0) / (tokens_per_step // mesh.dp)"),),
             r"`--nproc 4 --dp 4`: step 1 loss 24\.95\d+, one process's 6\.238\d+"),
    WrongFix(2, "the padded rows masked by the tested vocabulary's size, 500",
             (("nanohlat/tensor_parallel.py", MASK, MASK.replace("ids >= vocab_size", "ids >= 500")),), r"--vocab-size 400`: step 1 loss",
             keep=False),
    WrongFix(4, "every replicated group's gradient summed over tp, SP or not",
             (("nanohlat/optim.py", "sp = tp > 1 and whole and any(p.shard.sequence_parallel for p in params)",
               "sp = tp > 1 and whole"),),
             r"`--nproc 2 --tp 2 --check-replicas 1`: step 1 grad_norm 1\.074\d+"),
    WrongFix(6, "the zigzag places written out for cp 2",
             (("nanohlat/beyond/context_parallel.py", ROTARY,
               "c = t // 2; return torch.cat([torch.arange(c) + self.group.rank * c, torch.arange(c) + (3 - self.group.rank) * c])"),),
             r"`--nproc 4 --cp 4 --cp-attention allgather`: (step 1 (loss|grad_norm)|after the last step parameter)",
             keep=False),
    WrongFix(7, "the ep_dp groups made single ranks",
             (("nanohlat/beyond/moe.py", EP_DP, "    return [[r(d, p, t)] for p in range(pp) for t in range(tp) for d in range(dp)]\n"),),
             r"`--nproc 4 --dp 4 --ep 2 --check-replicas 1`: .*differs between its (ep_)?dp replicas", keep=False),
    WrongFix(8, "the step count set to the resumed step in train.py",
             (("train.py", "    session = Session(model_cfg, tcfg, mesh, dev, model, runner, opt, ds, resume_from)\n",
               "    session = Session(model_cfg, tcfg, mesh, dev, model, runner, opt, ds, resume_from)\n"
               "    opt.step_count.fill_(session.start_step)\n"),),
             r"its step 1 made non-finite by the lab .*\): (after the last step parameter \S+ differs|step 4 loss)"),
    WrongFix(9, "stochastic rounding with torch's random numbers",
             (("nanohlat/precision.py", SR, "master[p.start:p.stop].copy_(stochastic_round_to_bf16(w[p.start:p.stop]))"),),
             r"^`--precision bf16-sr --lr 1e-5 --min-lr 1e-5`: after the last step parameter \S+ differs", keep=False),
    WrongFix(9, "the counter noise of each element's local index",
             (("nanohlat/precision.py", NOISE, "noise = rounding_noise(mix64(key ^ p.name_key), local)"),),
             r"`--nproc 2 --tp 2 --precision bf16-sr --lr 1e-5 --min-lr 1e-5 --check-replicas 1` \(against the "
             r"reference's tp 2\): (step 2 grad_norm|after the last step parameter \S+ differs from the reference's)",
             keep=False),
    # -- the lab's own --
    WrongFix(2, "the mask one row short (ids > vocab_size)",
             (("nanohlat/tensor_parallel.py", MASK, MASK.replace("ids >= vocab_size", "ids > vocab_size")),),
             r"`--nproc 2 --tp 2`: step 1 loss", keep=False),
    WrongFix(3, "the shard's squares scaled by dp instead of summed over it",
             (("nanohlat/zero1.py", "        return sq", "        return sq * self.group.size"),),
             r"--zero 1`: step 1 grad_norm"),
    WrongFix(5, "the gathered shards rolled back by one (right at dp 2 only)",
             (("nanohlat/zero1.py", GATHER + ".flip(0)", GATHER + ".flip(0).roll(1, 0)"),),
             r"`--nproc 4 --dp 4 --zero 1`: step 2 loss"),
    WrongFix(6, "every rank given rank 0's places",
             (("nanohlat/beyond/context_parallel.py", ROTARY, "return self.positions(t)[0]"),),
             r"`--nproc 2 --cp 2 --cp-attention allgather --check-replicas 1`: step 1 (loss|grad_norm)", keep=False),
    WrongFix(10, "the right boundary made to skip the same ticks (no hang, no gradient either)",
             (("nanohlat/pipeline.py", "            if act_out is not None or grad_in is not None:\n",
               "            if act_out is not None:\n"),),
             r"--microbatches 2`: rank 0: KeyError"),
    WrongFix(12, "the grad norm's all-reduce over pp skipped off the last stage too",
             (("nanohlat/optim.py", "        sq = comm.all_reduce(sq, mesh.pp_group)\n",
               "        sq = comm.all_reduce(sq, mesh.pp_group) if mesh.is_last_stage else sq\n"),),
             r"`--nproc 2 --pp 2`: .*a collective waited \d+ s for its peer"),
    WrongFix(1, "train.py trains no step at all (issue 63: a copy that trained nothing passed)",
             (("train.py", "for step in range(session.start_step, tcfg.steps):", "for step in range(session.start_step, 0):"),),
             r"^`--nproc 2 --dp 2`: no step was logged \(metrics\.jsonl holds none\); one process's run logs steps 1, 2$"),
    WrongFix(1, "train.py stops after its first step",
             (("train.py", TRAIN_END, "if session.end_step(step + 1, loss, norm, finite, lr) or True:"),),
             r"^`--nproc 2 --dp 2`: it logged step 1, one process's run steps 1, 2: a run that stops early"),
    WrongFix(8, "the steps no longer logged (issue 63: `check bug8` raised IndexError)",
             (("nanohlat/run/session.py", "        self.log.step(step, loss, norm, lr, self.tokens_seen, last, figures)", "        pass"),),
             r"^one process: no step was logged \(metrics\.jsonl holds none\)"),
    WrongFix(13, "the master copied from the loaded bf16 weights",
             (("nanohlat/run/checkpoint/optimizer_state.py", "        g.store()\n",
               "        if not g.master_is_params:\n            g.master.copy_(g.flat[g.start:g.stop].float())\n"
               "        g.store()\n"),),
             r"`--precision bf16-mixed` \(4 steps, stopped .*\): (after the last step parameter \S+ differs|step 4 loss)"),
]


@pytest.fixture(scope="module")
def graded():
    from lab_grading import graded as grade_all
    return grade_all()


def test_every_wrong_fix_applies_and_the_first_eight_are_issue_58s():
    assert len({(f.n, f.what) for f in WRONG_FIXES}) == len(WRONG_FIXES) >= 9 + 8
    assert [f.n for f in WRONG_FIXES[:9]] == [1, 1, 2, 4, 6, 7, 8, 9, 9]
    for fix in WRONG_FIXES:
        assert texts(fix), fix.what
    for doc in ("tutorial.md", "docs/teaching.md"):   # the count they state
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            text = " ".join(f.read().split())
        assert f" {len(WRONG_FIXES)} wrong fixes fail it" in text or f" {len(WRONG_FIXES)} such wrong fixes" in text, doc


@pytest.mark.slow
@pytest.mark.parametrize("k", range(len(WRONG_FIXES)), ids=[f"bug{f.n}-{i}" for i, f in enumerate(WRONG_FIXES)])
def test_a_wrong_fix_fails_check_with_a_message_naming_what_caught_it(graded, k):
    fix = WRONG_FIXES[k]
    verdict = graded[f"wrong{k}"]
    assert verdict is not None, f"bug {fix.n}'s wrong fix passed check: {fix.what}"
    assert re.search(fix.catches, verdict), (fix.what, verdict)
