"""--cp N trains like one process (issue 37, step 2).

The mesh's cp dimension (between tp and dp) and its groups; this rank's share of a
batch (shift first, then the zigzag chunks); the refusals of what cp does not do yet (a
mixture of experts with cp: tests/beyond/test_moe_with_other_layouts.py);
and, in gloo workers, the tiny preset over 10 steps at --cp 2 with each
--cp-attention, with activation checkpointing, at cp 2 x dp 2 with ZeRO-1, 2 and 3,
at cp 2 x tp 2 (with SP) and cp 2 x pp 2, at cp 4 with each --cp-attention,
and from cp checkpoints resumed at cp 1,
at cp 4 and with another algorithm: every step's loss equal to one process's to
<= 1e-5 relative (fp32 round-off: the sums over the cp ranks add in another order;
measured <= 8.5e-8, one fp32 step of the loss), the grad norm as test_layouts_equal_one_process.py
allows it, and the weights after step 10 as test_layouts_equal_one_process.py compares them
(dist_utils.assert_same_weights): every parameter's gradients did what one process's did. A negative control (rotary angles at each rank's local places 0..T/cp-1
instead of its tokens' places in the whole sequence) and another (each rank attending
to its own tokens only) must be off by ten times the tolerance: measured 2.9e-4 and
3.4e-3 (this small model, in 10 steps, leans little on positions and context).
"""

from __future__ import annotations

import pytest
import torch

from conftest import read_metrics
from dist_utils import assert_same_weights, run_layouts
from nanohlat import recipe
from nanohlat.config import UserError
from nanohlat.beyond.context_parallel import ALGORITHMS
from nanohlat.beyond.context_parallel import ContextMesh
from nanohlat.mesh import Mesh
from nanohlat.plan.sheets import layout_table

LOSS_REL = 1e-5
CAUGHT = 10 * LOSS_REL   # the negative control must be off by at least this (relative, some step)


def test_the_cp_dimension_sits_between_tp_and_dp():
    m = ContextMesh(1, 1, 2, rank=3, cp=2)
    assert (m.dp_rank, m.cp_rank, m.tp_rank, m.world) == (1, 1, 0, 4)
    assert m._all("cp") == [[0, 1], [2, 3]] and m._all("dp") == [[0, 2], [1, 3]]
    assert m._all("dp_cp") == [[0, 1, 2, 3]]          # the four hold the same weights
    big = ContextMesh(2, 2, 2, rank=0, cp=2)                  # 16 ranks: tp neighbours, then cp, then dp, then pp
    assert big._all("tp")[0] == [0, 1] and big._all("cp")[0] == [0, 2] and big._all("dp")[0] == [0, 4]
    assert big._all("pp")[0] == [0, 8] and big._all("dp_cp")[0] == [0, 2, 4, 6]
    for kind in ("tp", "dp", "pp", "cp", "dp_cp"):     # each kind a partition of the world
        groups = big._all(kind)
        assert sorted(r for g in groups for r in g) == list(range(16)) and all(g == sorted(g) for g in groups)
    for r in range(16):                                # coordinates and groups agree
        me = ContextMesh(2, 2, 2, rank=r, cp=2)
        cp_group = next(g for g in big._all("cp") if r in g)
        assert cp_group.index(r) == me.cp_rank
        assert all(ContextMesh(2, 2, 2, rank=o, cp=2).cp_rank == i for i, o in enumerate(cp_group))
        assert all((ContextMesh(2, 2, 2, rank=o, cp=2).dp_rank, ContextMesh(2, 2, 2, rank=o, cp=2).pp_rank,
                    ContextMesh(2, 2, 2, rank=o, cp=2).tp_rank) == (me.dp_rank, me.pp_rank, me.tp_rank) for o in cp_group)
    assert Mesh(1, 1, 2).grad_group.name == "dp"       # cp 1: as before
    table = layout_table(1, 1, 2, 4, cp=2)
    assert table.splitlines()[:3] == ["world 4 = dp 2 x pp 1 x cp 2 x tp 1", "rank  dp  pp  cp  tp  layers",
                                      "   0   0   0   0   0  0-3  +embedding  +norm,head,loss"]


def test_a_rank_gets_its_zigzag_chunks_of_the_shifted_sequences():
    from nanohlat.data_parallel import split_batch

    class Cpu:
        torch_device = torch.device("cpu")
    tcfg = recipe.TrainConfig(batch_size=4, seq_len=8, microbatches=2, cp=2)
    batch = torch.arange(4 * 9).view(4, 9)             # sequence b holds 9b .. 9b + 8
    for rank, places in ((0, [0, 1, 6, 7]), (1, [2, 3, 4, 5]), (2, [0, 1, 6, 7])):
        mesh = ContextMesh(1, 1, 2, rank=rank, cp=2)
        tokens, targets = split_batch(batch, mesh, tcfg, Cpu())
        rows = [2 * mesh.dp_rank + i for i in range(2)]  # this dp rank's two sequences, one per micro-batch
        for mb, row in enumerate(rows):
            assert tokens[mb].tolist() == [[9 * row + p for p in places]]
            assert targets[mb].tolist() == [[9 * row + p + 1 for p in places]]   # the next token, wherever it is


@pytest.mark.parametrize("flags, named", [
    (["--seq-len", "30"], "not a multiple of 4"),
    (["--cp-attention", "ulysses", "--cp", "8", "--seq-len", "32"], "divisible by --cp 8"),
    (["--cp-attention", "ulysses", "--tp", "8"], "its 1 heads and 1 kv heads"),   # heads / tp: 1 per tp rank
    (["--cp-attention", "flash"], "--cp-attention 'flash' is not one of allgather, ring, ulysses")])
def test_what_cp_does_not_do_yet_is_refused_in_one_line(flags, named):
    with pytest.raises(UserError) as e:
        recipe.parse_args(["--preset", "tiny", "--cp", "2"] + flags)
    assert named in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("flags, named", [(["--device", "xla"], "not supported on xla")])
def test_train_py_refuses_with_exit_2_and_one_line(flags, named, capsys):
    import train
    assert train.main(["--preset", "tiny", "--nproc", "2", "--cp", "2", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and len(err.splitlines()) == 1, err


def test_a_layout_that_does_not_divide_the_world_names_cp():
    from nanohlat.recipe import check_layout as validate_layout
    with pytest.raises(UserError, match=r"--tp 1 x --pp 1 x --cp 2 = 2 does not divide the world size 3"):
        validate_layout(*recipe.parse_args(["--preset", "tiny", "--cp", "2"]), 3)
    assert validate_layout(*recipe.parse_args(["--preset", "tiny", "--cp", "2"]), 4) == 2   # dp = 4 / cp


# --------------------------------------------------------------------------- training

def _flags(cache_dir, out, *extra):
    return ["--preset", "tiny", "--steps", "10", "--device", "cpu", "--cache-dir", cache_dir, "--out-dir", str(out),
            "--eval-every", "0", *[str(e) for e in extra]]


def _local_rotary(rank: int) -> None:
    """The negative control: every cp rank rotates its tokens as if they were 0 .. T/cp - 1."""
    from nanohlat.beyond import context_parallel
    context_parallel.Context.token_positions = lambda self, t: torch.arange(t)


def _local_attention(rank: int) -> None:
    """The second negative control: each cp rank attends over its own tokens only (no exchange)."""
    from nanohlat.beyond import context_parallel
    from nanohlat.model import causal_attention
    # a rank's tokens are in position order (chunk i, then chunk 2n-1-i): causal among themselves
    context_parallel.Context.attention = lambda self, q, k, v: causal_attention(q, k, v)


def _compare(ref: dict, got: list, first: int, name: str) -> float:
    assert [m["step"] for m in got] == list(range(first, 11)), name
    worst = 0.0
    for m in got:
        r = ref[m["step"]]
        worst = max(worst, abs(m["loss"] - r["loss"]) / r["loss"])
        assert abs(m["loss"] - r["loss"]) <= LOSS_REL * r["loss"], (name, m, r)
        rel = 1e-6 if m["step"] == 1 else 1e-4   # test_layouts_equal_one_process.py: round-off Adam amplifies in tiny gradients
        assert abs(m["grad_norm"] - r["grad_norm"]) <= rel * r["grad_norm"], (name, m, r)
    return worst


@pytest.mark.slow
def test_cp_2_trains_like_one_process_and_its_checkpoints_move(cache_dir, tmp_path):
    """One process, then at cp 2 (2 workers) each algorithm (allgather saving at step 5),
    ring with selective activation checkpointing (the recompute repeats the exchanges) and
    its replicas checked bitwise every step, allgather with full checkpointing; at cp 2 x
    dp 2 (4 workers) ZeRO-1 (saving at step 5), ZeRO-2, ZeRO-3 (replicas checked: the dp x
    cp ranks hold the same weights, bitwise); cp 2 x tp 2 ring with SP and ulysses (heads/tp
    split over cp), cp 2 x pp 2 1F1B allgather; cp 4 ulysses resumed from
    cp 2 allgather's step 5; one process resumed from both cp checkpoints; cp 2 ring resumed
    from cp 2 x dp 2's. Then the negative control."""
    def ckpt(name):
        return str(tmp_path / name / "checkpoints" / "step_00000005")
    run_layouts(1, [_flags(cache_dir, tmp_path / "one")], str(tmp_path / "err1"))
    run_layouts(2, [_flags(cache_dir, tmp_path / "allgather", "--cp", 2, "--save-every", 5),
                    _flags(cache_dir, tmp_path / "ring", "--cp", 2, "--cp-attention", "ring"),
                    _flags(cache_dir, tmp_path / "ulysses", "--cp", 2, "--cp-attention", "ulysses")],
                str(tmp_path / "err2"))
    run_layouts(2, [_flags(cache_dir, tmp_path / "ring_selective", "--cp", 2, "--cp-attention", "ring",
                           "--activation-checkpointing", "selective", "--check-replicas", 1),
                    _flags(cache_dir, tmp_path / "allgather_full", "--cp", 2, "--activation-checkpointing", "full")],
                str(tmp_path / "err2c"))
    run_layouts(4, [_flags(cache_dir, tmp_path / "cp2_dp2_zero1", "--cp", 2, "--cp-attention", "ring", "--zero", 1,
                           "--microbatches", 2, "--save-every", 5),
                    _flags(cache_dir, tmp_path / "cp2_dp2_zero3", "--cp", 2, "--cp-attention", "ulysses", "--zero", 3,
                           "--check-replicas", 1),
                    _flags(cache_dir, tmp_path / "cp2_dp2_zero2", "--cp", 2, "--cp-attention", "allgather", "--zero", 2),
                    _flags(cache_dir, tmp_path / "cp2_tp2_sp_ring", "--cp", 2, "--cp-attention", "ring", "--tp", 2,
                           "--sequence-parallel"),
                    _flags(cache_dir, tmp_path / "cp2_tp2_ulysses", "--cp", 2, "--cp-attention", "ulysses", "--tp", 2),
                    _flags(cache_dir, tmp_path / "cp2_pp2_1f1b_allgather", "--cp", 2, "--pp", 2, "--microbatches", 2),
                    _flags(cache_dir, tmp_path / "cp4_from_cp2", "--cp", 4, "--cp-attention", "ulysses",
                           "--resume", ckpt("allgather")),
                    *[_flags(cache_dir, tmp_path / f"cp4_{a}", "--cp", 4, "--cp-attention", a) for a in ALGORITHMS]],
                str(tmp_path / "err4"))
    run_layouts(1, [_flags(cache_dir, tmp_path / "one_from_cp2", "--resume", ckpt("allgather")),
                    _flags(cache_dir, tmp_path / "one_from_cp2_dp2", "--zero", 1, "--resume", ckpt("cp2_dp2_zero1"))],
                str(tmp_path / "err1b"))
    run_layouts(2, [_flags(cache_dir, tmp_path / "ring_from_cp2_dp2", "--cp", 2, "--cp-attention", "ring",
                           "--resume", ckpt("cp2_dp2_zero1"))], str(tmp_path / "err2b"))
    ref = {m["step"]: m for m in read_metrics(str(tmp_path / "one"))}
    runs = {"allgather": 1, "ring": 1, "ulysses": 1, "ring_selective": 1, "allgather_full": 1, "cp2_dp2_zero1": 1,
            "cp2_dp2_zero2": 1, "cp2_dp2_zero3": 1, "cp2_tp2_sp_ring": 1, "cp2_tp2_ulysses": 1,
            "cp2_pp2_1f1b_allgather": 1, "cp4_from_cp2": 6, "one_from_cp2": 6,
            "one_from_cp2_dp2": 6, "ring_from_cp2_dp2": 6, **{f"cp4_{a}": 1 for a in ALGORITHMS}}
    worst = {name: _compare(ref, read_metrics(str(tmp_path / name)), first, name) for name, first in runs.items()}
    print("max relative loss difference from one process:", worst)
    # and the same weights after step 10: what the gradients of every parameter did, step by step
    from nanohlat import device as devicelib
    from nanohlat.serving.generate import load_model
    ref_model, _ = load_model(str(tmp_path / "one"), devicelib.get_device("cpu"))
    ref_weights = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    for name in runs:
        assert_same_weights(tmp_path / name, ref_weights)

    # serving is at cp 1: the cp 2 checkpoint loads through the one inference loader, and its loss on
    # step 6's batch is the loss the uninterrupted one-process run logged at step 6
    from nanohlat.run import preflight
    model, _ = load_model(ckpt("allgather"), devicelib.get_device("cpu"))
    _, tcfg, ds, *_ = preflight.inputs(*recipe.parse_args(_flags(cache_dir, tmp_path / "serve")))
    batch = ds.batch(5, tcfg.batch_size, tcfg.seq_len, tcfg.seed)
    with torch.no_grad():
        served = float(model(batch[:, :-1], batch[:, 1:]).mean())
    assert abs(served - ref[6]["loss"]) <= LOSS_REL * ref[6]["loss"], (served, ref[6])

    for control in (_local_rotary, _local_attention):
        out = tmp_path / control.__name__
        run_layouts(2, [_flags(cache_dir, out, "--cp", 2)], str(tmp_path / f"err{control.__name__}"), setup=control)
        off = max(abs(m["loss"] - ref[m["step"]]["loss"]) / ref[m["step"]]["loss"] for m in read_metrics(str(out)))
        print(control.__name__, "off by", off)
        assert off > CAUGHT, (control.__name__, off)
        with pytest.raises(AssertionError):                 # and the weights' check sees it too
            assert_same_weights(out, ref_weights)


BF16_LOSS_REL = 1e-3   # half of one bf16 rounding of the loss (8 significant bits: up to 2^-9 = 2e-3 relative)


@pytest.mark.slow
def test_cp_in_bf16_is_as_close_to_one_process_as_tp_is(cache_dir, tmp_path):
    """In bf16 (--precision bf16-sr, HLAT's) no layout gives one process's losses to fp32
    round-off: a different split of a matmul or a softmax rounds its partial sums to bf16
    in another order. What cp must show is that it costs no more than any other layout
    does. One process, tp 2 (the layout the suite trusts) and cp 2 with each algorithm,
    replicas checked bitwise every step (--check-replicas 1): every step's loss within
    BF16_LOSS_REL of one process's, and the no-exchange control (each rank attending to its
    own tokens) outside it. Measured as this test runs them (one thread per rank, 2-core CPU,
    torch 2.13, the largest over the 10 steps; the optimizer's fused update, tools/fast_adamw.py):
    tp 2 1.5e-4, allgather 1.6e-4, ring 7.1e-5, ulysses 5.7e-5, the control 3.2e-3 (with the
    blocked update, FlatAdamW's bits, before the fused kernel: 1.4e-4, 9.4e-5, 4.1e-5, 3.3e-5, 3.2e-3). So the
    tolerance sits 6.4x above the worst layout here and 3.2x below the control; an outside review
    measured up to 4.2e-4 for tp 2, ring and ulysses on an earlier tree, 2.4x below the tolerance:
    the margin is that, not more. (Over 20 steps tp 2, ring and ulysses reached 2.9-4.1e-4 and
    allgather 1.5e-3, once a clipped spike parted its gradient norm from one process's:
    docs/design.md. This test stays at 10 steps.)
    The grad norm is not compared: this tiny model's norm jumps from step to step (0.96 ->
    2.07 at steps 8-9) and there bf16's reorderings move it by 9-15% at tp 2 as much as at
    cp 2, so it tells nothing about cp."""
    bf16 = ["--precision", "bf16-sr"]
    run_layouts(1, [_flags(cache_dir, tmp_path / "one", *bf16)], str(tmp_path / "err1"))
    runs = {"tp2": ["--tp", 2], **{a: ["--cp", 2, "--cp-attention", a, "--check-replicas", 1]
                                   for a in ("allgather", "ring", "ulysses")}}
    run_layouts(2, [_flags(cache_dir, tmp_path / name, *bf16, *extra) for name, extra in runs.items()],
                str(tmp_path / "err2"))
    run_layouts(2, [_flags(cache_dir, tmp_path / "control", *bf16, "--cp", 2)], str(tmp_path / "errc"),
                setup=_local_attention)
    ref = {m["step"]: m["loss"] for m in read_metrics(str(tmp_path / "one"))}

    def worst(name):
        got = read_metrics(str(tmp_path / name))
        assert [m["step"] for m in got] == list(range(1, 11)), name
        return max(abs(m["loss"] - ref[m["step"]]) / ref[m["step"]] for m in got)
    off = {name: worst(name) for name in [*runs, "control"]}
    print("bf16-sr: max relative loss difference from one process:", off)
    assert all(off[name] <= BF16_LOSS_REL for name in runs), off
    assert off["control"] > BF16_LOSS_REL, off
