"""The debugging lab's bugs (tutorial.md chapter 12): what each plants, what it shows, how it is graded.

This file is the lab's answer key. A bug's copy (`python -m nanohlat.classroom
bug N DIR`) never holds it, nor any other file that names or patches a bug
(left_out); the copy's LAB.md says what a user sees and records which bug it
holds by an opaque id (lab.lab_id). `check` grades with the installed
nanohlat's lab.py and this file, never with code in the copy.

A bug is a patch: an exact piece of the reference code (`old`, exactly once in
`file`) and what replaces it (`new`). Reverting it is the reference fix.

Its `cases` are the runs `check` grades, each beside the reference's one
process with the same flags (lab.py): the layouts that show the bug
(`shows`: LAB.md lists them) and their neighbours, the layouts a fix that only
special-cases the one that shows it would break (another degree, tp without
SP, another vocabulary, a gradient clip that does not bite), and the bug's own
probe (a resume after a skipped step, stochastic rounding at another layout).
tests/classroom/test_debugging_lab.py holds LAB.md to the runs: every case that `shows`
differs from one process, every other one trains like it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Layouts (beside lab.BASE's flags)
ONE = ()
DP2, DP4 = ("--nproc", "2", "--dp", "2"), ("--nproc", "4", "--dp", "4")
TP2 = ("--nproc", "2", "--tp", "2")
SP2 = TP2 + ("--sequence-parallel",)
Z2, Z4 = DP2 + ("--zero", "1"), DP4 + ("--zero", "1")
PP2 = ("--nproc", "2", "--pp", "2")
CP2 = ("--nproc", "2", "--cp", "2", "--cp-attention", "allgather")
CP4 = ("--nproc", "4", "--cp", "4", "--cp-attention", "allgather")
EP2, EP4 = DP2 + ("--ep", "2"), DP4 + ("--ep", "2")
MOE = ("--moe-experts", "4", "--moe-top-k", "2")
REPLICAS = ("--check-replicas", "1")
SMALL_BUCKETS = ("--bucket-mb", "0.01")    # 2,621 elements a bucket: several per flat buffer at the tiny preset
STOP_RESUME = (("--steps", "4", "--stop-after", "2"), ("--steps", "4", "--resume", "auto"))
LOW_LR = ("--lr", "1e-5", "--min-lr", "1e-5")
RESUMED = "4 steps, stopped after step 2 with --stop-after 2 and resumed with --resume auto"


@dataclass(frozen=True)
class Case:
    """One run `check` grades: `flags` (beside lab.BASE; a layout's included), then the further
    `legs` of the same run (a resume), with `nan_step` made non-finite (the lab injects it). The
    reference it must equal is one process with the same flags, run straight (lab.baseline)."""
    flags: tuple
    shows: bool                 # the planted bug shows here (LAB.md: "shows"; else "trains like one process")
    legs: tuple = ()
    nan_step: int = 0
    same: bool = False          # compared with the reference at the same layout, not one process (bf16 compute
                                # rounds each layout's partial sums its own way: only the same layout is exact)
    say: str = ""               # how LAB.md names it, when the flags alone do not say it

    def words(self) -> str:
        """How LAB.md and a verdict name it: its flags (or one process), and what they do not say."""
        run = f"`{' '.join(self.flags)}`" if self.flags else "one process"
        return f"{run} ({self.say})" if self.say else run


@dataclass(frozen=True)
class Bug:
    n: int
    title: str                  # what a user sees, in a line: its name in `list` (never where it is)
    area: str
    level: int                  # 1 easy .. 3 hard: the order chapter 12 takes them in
    file: str
    old: str                    # the reference's text (exactly once in `file`)
    new: str                    # what the bug puts there
    symptom: str                # LAB.md's "what you see" (every figure in it is a run's: the tests hold it)
    cases: tuple
    solution: str               # what was wrong (tutorial.md's solutions; never in a copy)
    base: tuple = ()            # flags of every run of it

    @property
    def shows(self) -> list[Case]:
        return [c for c in self.cases if c.shows]


ZERO_NORM_NOTE = "(a grad norm that is not a gradient's)"

BUGS = [
    Bug(0, "dp 2's loss off one process's from step 1 (the worked example)", "DP", 0, "nanohlat/data_parallel.py",
        "    mine = batch[mesh.dp_rank * per_rank:(mesh.dp_rank + 1) * per_rank]\n",
        "    mine = batch[:per_rank]\n",
        "tutorial.md chapter 12 works through this one.",
        (Case(DP2, True), Case(TP2, False), Case(("--microbatches", "2"), False)),
        "Every dp rank took the first per_rank sequences of the global batch (split_batch), so dp 2 trained on half "
        "the batch, twice: rank r's share starts at dp_rank * per_rank."),
    Bug(1, "the loss about twice one process's at dp 2", "DP", 1, "train.py",
        "runner.run(tokens, targets, 1.0 / tokens_per_step)",
        "runner.run(tokens, targets, 1.0 / (tokens_per_step // mesh.dp))",
        "At dp 2 the loss printed at step 1 is 12.48, one process's 6.24, and the grad norm 2.15 against 1.07; at "
        "dp 4 both are four times one process's.",
        (Case(DP2, True), Case(DP2 + ("--grad-clip", "1.5"), True, say="a clip that does not bite"), Case(DP4, True)),
        "train.py scaled each rank's loss by 1 / its own tokens (tokens_per_step // dp), then global_mean and the "
        "gradient all-reduce summed over dp: dp times the mean. Scale by 1 / the global batch's tokens. (A kindred "
        "public report: verl-project/verl issue 5625, a loss divided by the local token count.)"),
    Bug(2, "tp 2's loss above one process's with a vocabulary of 500", "TP", 1, "nanohlat/tensor_parallel.py",
        '    logits = logits.masked_fill(ids >= vocab_size, float("-inf"))\n', "",
        "With --vocab-size 500 (512 rows of the head once padded, 256 a tp rank) tp 2's loss at step 1 is 6.254, "
        "one process's 6.230; with a vocabulary that fills its padded size (--vocab-size 512) the two agree.",
        (Case(TP2, True), Case(TP2 + ("--vocab-size", "400"), True), Case(TP2 + ("--vocab-size", "512"), False)),
        "The vocab-parallel cross-entropy did not mask the padded vocabulary rows (ids >= vocab_size) to -inf: "
        "they took probability mass in the softmax's sum. Mask them before the max and the sum.",
        base=("--vocab-size", "500")),
    Bug(3, "the grad norm of --zero 1 off one process's", "DP/ZeRO", 1, "nanohlat/zero1.py",
        '        return comm.all_reduce(sq, self.group, what="grad norm")', "        return sq",
        "At dp 2 with --zero 1 the loss of step 1 agrees with one process's and its grad norm does not (0.78 "
        "against 1.07); at dp 2 without --zero the two agree.",
        (Case(Z2, True), Case(DP2, False), Case(Z4, True)),
        "ZeRO-1's sum of squares was not added up over dp: each rank held a different shard and took its own "
        "shard's norm for the whole model's, so clipping used the wrong norm. All-reduce it over dp."),
    Bug(4, "tp 2 with --sequence-parallel stopped by the replica check", "TP/SP", 2, "nanohlat/model.py",
        "self.weight = shard_spec._param((dim,), None, 1, sequence_parallel=sequence_parallel)",
        "self.weight = shard_spec._param((dim,), None, 1)",
        "tp 2 trains like one process; tp 2 with --sequence-parallel stops after step 1: --check-replicas 1 says "
        "a parameter differs between its tp replicas.",
        (Case(SP2 + REPLICAS, True), Case(TP2 + REPLICAS, False)),
        "The RMSNorm gain was not marked sequence-parallel, so its gradient (each tp rank saw only its own tokens) "
        "was never summed over tp: every rank stepped its own partial gradient. Mark it (shard_spec). (The same "
        "defect, reported: NVIDIA/Megatron-LM issue 1446, final_layernorm's gradient differing over tp ranks with "
        "sequence parallelism.)"),
    Bug(5, "--zero 1 right at step 1, off at step 2", "DP/ZeRO", 2, "nanohlat/zero1.py",
        "comm.all_gather(shard[a:b].contiguous(), group).view(group.size, b - a)",
        "comm.all_gather(shard[a:b].contiguous(), group).view(group.size, b - a).flip(0)",
        "--zero 1 at dp 2: step 1's loss and grad norm equal one process's, step 2's loss is 6.250 against 6.214, "
        "and --check-replicas 1 finds nothing.",
        (Case(Z2 + REPLICAS, True), Case(Z4, True), Case(DP2, False)),
        "ZeRO-1's all-gather put the shards back in the reverse rank order: every rank got the same, wrong, "
        "weights. Row r of the gathered buffer is rank r's shard."),
    Bug(6, "cp 2's grad norm off one process's, its loss nearly right", "CP", 2, "nanohlat/beyond/context_parallel.py",
        "return self.positions(t)[self.group.rank]",
        "return torch.arange(t)",
        "cp 2's loss of step 1 agrees with one process's to 1e-6 relative, its grad norm differs by 1e-4 relative; "
        "the ledger equals the plan and the replicas agree.",
        (Case(CP2 + REPLICAS, True), Case(CP4, True), Case(TP2, False)),
        "Under cp the rotary angles used each rank's local positions 0..t-1, not its tokens' places in the "
        "whole sequence (zigzag_positions): rank 1's queries and keys were rotated as if they began the sequence. "
        "A forward bug whose loss barely moves: at initialisation attention is nearly uniform (every query's scores "
        "are about equal), so where a key sits hardly changes what a query takes; the gradient with respect to the "
        "angles is what differs."),
    Bug(7, "--ep 2 stopped by the replica check", "MoE/EP", 2, "nanohlat/beyond/moe.py",
        "    return [[r(d, p, t) for d in range(j, dp, ep)] for p in range(pp) for t in range(tp) "
        "for j in range(ep)]\n",
        "    return [[r(d, p, t) for d in range(i, i + ep)] for p in range(pp) for t in range(tp) "
        "for i in range(0, dp, ep)]\n",
        "A mixture at dp 2 trains like one process; at dp 2 with --ep 2, --check-replicas 1 stops the run after "
        "step 1: a weight of the mixture differs between the ranks it calls ep_dp replicas.",
        (Case(EP2 + REPLICAS, True), Case(DP2 + REPLICAS, False), Case(EP4 + REPLICAS, True)),
        "The experts' gradients were summed over the ranks of an ep group, which hold DIFFERENT experts, instead "
        "of over ep_dp, the ranks holding the same ones: each expert stepped with another's gradient added.",
        base=MOE),
    Bug(8, "a resumed run that does not continue like the run never stopped", "checkpoints", 2,
        "nanohlat/run/checkpoint/reshard.py",
        'step_count = shards.manifest.get("schedule", {}).get("optimizer_step", 0)',
        'step_count = shards.manifest.get("schedule", {}).get("optimizer_steps", 0)',
        "Every layout trains like one process, but a run stopped after step 2 and resumed (--stop-after 2, then "
        "--resume auto) does not continue like the run never stopped: step 3 agrees (the loss of the weights it "
        "saved), step 4 does not, 5.920 against 5.968.",
        (Case(ONE, False), Case(ONE, True, legs=STOP_RESUME, say=RESUMED),
         Case(ONE, True, legs=STOP_RESUME, nan_step=1,
              say=RESUMED + "; its step 1 made non-finite by the lab (a NaN loss: the update skipped)")),
        "The optimizer's step count was not restored on resume (the manifest's key misspelt, so its default, 0): "
        "Adam's bias correction started over, so the first update after a resume was far larger. Restore "
        "schedule.optimizer_step, the count of the updates taken (a skipped non-finite step is none)."),
    Bug(9, "--precision bf16-sr learning less at a small learning rate", "precision", 3, "nanohlat/precision.py",
        "master[p.start:p.stop].copy_(stochastic_round_to_bf16(w[p.start:p.stop], noise=noise))",
        "master[p.start:p.stop].copy_(w[p.start:p.stop].to(master.dtype))",
        "--precision bf16-sr trains and its replicas agree, but at --lr 1e-5 its loss falls about half as far as "
        "it should: over 40 steps 0.012, where fp32 falls 0.021. Measure how far the stored weights move.",
        (Case(("--precision", "bf16-sr") + LOW_LR, True),
         Case(TP2 + ("--precision", "bf16-sr") + LOW_LR + REPLICAS, True, same=True,
              say="against the reference's tp 2"),
         Case(("--precision", "fp32") + LOW_LR, False)),
        "bf16-sr's update was stored with round-to-nearest: an update under half a bf16 gap rounds back to the "
        "old weight, so small updates vanish (HLAT's lesson). Round stochastically, with the counter noise of each "
        "element's place in the full parameter: E[round(x)] = x, and every holder of an element in every layout "
        "rounds it alike."),
    Bug(10, "pp 2 with 2 micro-batches never finishing step 1", "PP", 2, "nanohlat/pipeline.py",
        "            if act_in is not None or grad_out is not None:\n",
        "            if act_in is not None:\n",
        "pp 2 with 2 micro-batches never finishes step 1: no error, no progress, until the collective timeout "
        "ends it; dp 2 trains like one process. Run it with a short --collective-timeout and read which collective "
        "each rank waited in.",
        (Case(PP2 + ("--microbatches", "2"), True), Case(DP2, False)),
        "The last stage skipped the left boundary's exchange in the ticks where it only SENT a gradient: the "
        "exchange is a collective both stages must call, so stage 0 waited for a partner that never came."),
    Bug(11, "--zero 1 with small gradient buckets off one process's from step 2", "DP/ZeRO", 3, "nanohlat/zero1.py",
        "piece = r.grad.view(n, -1)[:, a:b].contiguous().view(-1)",
        "piece = r.grad[a * n:b * n]",
        "--zero 1 at dp 2 trains like one process with the default --bucket-mb; with --bucket-mb 0.01 step 1 "
        "agrees and step 2's loss is 6.267 against 6.214; without overlap (--no-overlap-grad-reduce) it agrees again.",
        (Case(Z2 + SMALL_BUCKETS, True), Case(Z2, False),
         Case(Z2 + SMALL_BUCKETS + ("--no-overlap-grad-reduce",), False)),
        "With overlap, a bucket's reduce-scatter (ZeroOneDP.start) took a contiguous run of the flat buffer, not the "
        "bucket's columns of every dp rank's row: with one bucket the two are the same, with several each rank's "
        "shard received other elements' sums. Cut the bucket as reduce_scatter_buckets does: columns [a, b) of "
        "the (dp, S) view."),
    Bug(12, "pp 2 hanging after step 1, its ledger a call short", "PP", 3, "nanohlat/data_parallel.py",
        'return comm.all_reduce(comm.all_reduce(x, mesh.pp_group), mesh.grad_group, what="loss")',
        'return comm.all_reduce(comm.all_reduce(x, mesh.pp_group) if mesh.is_last_stage else x, mesh.grad_group, '
        'what="loss")',
        "pp 2 prints its comm ledger after step 1, whose pp.all_reduce row counts 1 call where the plan predicts 2, "
        "then waits until the collective timeout ends it: rank 0 in world.all_reduce, rank 1 in pp.all_reduce. dp 2 "
        "trains like one process.",
        (Case(PP2, True), Case(DP2, False)),
        "The first stage skipped the loss's all-reduce over pp (it holds no loss). Collectives of a group are "
        "matched by order, not by name: its next one on that group, the grad norm's, met the last stage's loss "
        "sum, and from there on the two stages waited in different calls. Every rank of a group must make the same "
        "calls, in the same order; the comm ledger's calls per group show one missing."),
    Bug(13, "a bf16-mixed run that drifts after a resume", "checkpoints", 3,
        "nanohlat/run/checkpoint/optimizer_state.py",
        'for key in ("master", "exp_avg", "exp_avg_sq"):',
        'for key in ("exp_avg", "exp_avg_sq"):',
        "Under --precision bf16-mixed a run stopped after step 2 and resumed continues unlike the run never "
        "stopped: step 3 agrees, step 4's loss is 6.167 against 5.968, as if training had been lost. In fp32 and "
        "bf16-sr, resume is exact.",
        (Case(("--precision", "bf16-mixed"), True, legs=STOP_RESUME, say=RESUMED),
         Case(("--precision", "fp32"), False, legs=STOP_RESUME, say=RESUMED),
         Case(("--precision", "bf16-sr"), False, legs=STOP_RESUME, say=RESUMED)),
        "The resume filled Adam's moments but not the master weights: where the master is the parameters (fp32, "
        "bf16-sr) loading the weights restored it, but bf16-mixed keeps a separate fp32 master, which stayed as "
        "initialised, so the first update after the resume was applied to the initial weights. Restore the master "
        "too (import_state's keys)."),
]
BY_N = {b.n: b for b in BUGS}
LAB = [b for b in BUGS if b.n > 0]   # the lab's bugs (0 is chapter 12's worked example)



def left_out(path: str) -> bool:
    """Whether a bug's copy leaves out the file at `path` (relative to the repository): this file, and the
    lab's tests (test_debugging_lab*.py and lab_grading.py, wherever under tests/), which plant
    every bug and its wrong fixes; and any other bug's copy made inside the repository (a folder with a
    LAB.md). (tutorial.md's solutions are cut out of the copy: lab.without_answers.)"""
    name = os.path.basename(path)
    if os.path.isfile(os.path.join(REPOSITORY, path, "LAB.md")):   # a lab copy made inside the repository
        return True
    return path.replace(os.sep, "/") == "nanohlat/classroom/lab_bugs.py" or (
        path.replace(os.sep, "/").startswith("tests/")
        and (name.startswith("test_debugging_lab") or name == "lab_grading.py"))
