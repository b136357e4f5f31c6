"""The plan's time, by hand (the standards: plan_utils.py): the step-time estimate's arithmetic,
the dp ring walked hop by hop over the groups every rank joins, recomputation's cost; the layout
search (every valid layout of a small case, HLAT's own placed); the pipeline's bubbles; and the
interleaved and ZB-H1 schedules in the plan: their activations, exchanges and bubbles."""

from __future__ import annotations

import dataclasses
import itertools
import os
import time

import pytest
import torch

from nanohlat import recipe
from nanohlat.tools import metrics
from nanohlat import plan
from nanohlat.plan import layout_search
from nanohlat.mesh import Mesh
from plan_utils import TINY, plan_in_seconds


def test_step_time_estimate_by_hand():
    """tiny, 4 ranks: tp 2 x pp 2, 2 micro-batches of 4 x 32 tokens, fp32, on
    'cpu' peaks (95 GFLOP/s, 1 thread) and a made-up network of 2 devices per
    node: tp pairs inside a node, the pipeline pair across."""
    net = plan.Network("test node", 2, inside=1e9, across=1e8, latency_inside=1e-5, latency_across=1e-4, note="")
    model, train = recipe.parse_args(TINY + ["--tp", "2", "--pp", "2", "--microbatches", "2", "--device", "cpu"])
    est = plan.estimate_step(model, train, 4, "cpu", utilisation=0.4, network=net)
    assert est["inside"] == {"tp": True, "pp": False, "dp": True, "kv": True}   # kv: one rank per kv head here

    # compute: 6 x matmul weights + 12 L d T per token, 256 tokens, 4 ranks, 40% of 95 GFLOP/s
    d, L, T, kv, ffn, V = 64, 4, 32, 4 * 8, 176, 512
    per_token = 6 * (L * (2 * d * d + 2 * d * kv + 3 * d * ffn) + d * V) + 12 * L * d * T
    assert per_token == 1_400_832
    compute = per_token * 256 / 4 / (95e9 * 0.4)
    assert est["compute"] == pytest.approx(compute, rel=1e-12)

    # tp, last stage (the slower): per micro-batch its 2 layers x 4 all-reduces of (4, 32, 64) fp32 =
    # 32 KiB, each sending 2(n-1)/n = 1 x its size; the head's all-reduce; the loss's all-gather of
    # 2 x (4, 32) fp32 maxima (sending half) and 2 all-reduces of (4, 32) fp32; then the grad-norm scalar
    act = 4 * 32 * 64 * 4
    wire = 2 * (2 * 4 * act + act + 2 * 4 * 32 * 4 // 2 + 2 * 4 * 32 * 4) + 4
    calls = 2 * (2 * 4 + 1 + 1 + 2) + 1
    assert (wire, calls) == (592_900, 25)
    tp = wire / 1e9 + calls * 1e-5
    # pp: 1F1B on 2 stages with 2 micro-batches has 4 ticks with traffic at the boundary
    # (F0, F1 cross; then B0, B1): 2 activations sent, 2 zero tensors; + loss and grad-norm scalars
    pp = (2 * act + 2 * act + 2 * 4) / 1e8 + (4 + 2) * 1e-4
    assert est["comm"]["tp"] == pytest.approx(tp, rel=1e-12)
    assert est["comm"]["pp"] == pytest.approx(pp, rel=1e-12)
    assert est["comm"]["dp"] == 0

    # a micro-batch's forward + backward with its communication; m = 2 of them, plus p - 1 = 1 of bubble
    per_mb = (compute + tp + pp) / 2
    assert est["bubble"] == pytest.approx(per_mb, rel=1e-12)
    assert est["step"] == pytest.approx(3 * per_mb, rel=1e-12)
    assert est["tokens_per_s"] == pytest.approx(256 / (3 * per_mb), rel=1e-12)
    assert est["mfu"] == pytest.approx(per_token * 256 / (3 * per_mb * 4 * 95e9), rel=1e-12)


def test_dp_ring_is_modelled_hop_by_hop():
    """hlat-7b on 64 trn1.32xlarge: tp 8 leaves 4 dp ranks per 32-core node, so
    rank 0's dp ring 0 -> 8 -> 16 -> 24 -> 32 -> ... leaves its node on one hop
    in 4 (24 -> 32, ..., 2040 -> 0): 64 hops off node, 192 on NeuronLink. The 8
    rings (one per tp rank) each leave a node once, so 8 hops share its 800 Gbps
    of EFA: 12.5 GB/s each, not the 1/32 share (3.125 GB/s) of a network split
    evenly over every core. The ring goes at its slowest hop's pace."""
    net = plan.NETWORKS["NeuronCore-v2"]
    hops = plan.ring_hops(list(range(0, 2048, 8)), 32)
    assert hops[:4] == [(0, 8, False), (8, 16, False), (16, 24, False), (24, 32, True)]
    assert hops[-1] == (2040, 0, True)
    ring = plan.dp_ring(8, 1, 256, net)
    assert (ring.ranks_per_node, ring.on_node, ring.off_node, ring.sharing) == (4, 192, 64, 8)
    assert ring.off_node_bw == ring.bandwidth == 800e9 / 8 / 8
    assert ring.latency == net.latency_across

    model, train = recipe.parse_args(["--preset", "hlat-7b"])
    est = plan.estimate_step(model, train, 2048, "NeuronCore-v2")
    wire = plan.comm_per_step(model, train, Mesh(8, 1, 256, 0))["dp.all_reduce"]
    assert est["dp_bytes"] == wire["wire"]
    assert est["comm"]["dp"] == pytest.approx(wire["wire"] / 12.5e9 + wire["calls"] * 30e-6, rel=1e-12)

    # one dp rank per node (tp 32): every hop leaves it, 32 rings share it, as before
    ring = plan.dp_ring(32, 1, 64, net)
    assert (ring.on_node, ring.off_node, ring.sharing) == (0, 64, 32) and ring.bandwidth == net.across
    # the whole ring in one node: NeuronLink only
    ring = plan.dp_ring(8, 1, 4, net)
    assert (ring.on_node, ring.off_node, ring.bandwidth, ring.latency) == (4, 0, net.inside, net.latency_inside)
    # with pipeline stages, more rings run at once: pp 2 x tp 4 = 8 rings; 8 dp ranks per node
    ring = plan.dp_ring(4, 2, 256, net)
    assert (ring.ranks_per_node, ring.off_node, ring.sharing) == (8, 32, 4)


def test_the_dp_rings_the_plan_walks_are_the_groups_every_rank_joins():
    """hardware.dp_groups, the rings whose hops the estimate walks, are mesh.py's dp groups: one per
    (stage, tp rank), in dp-rank order (the ring order), and each rank's own dp group, built as
    training builds it, is one of them: for every small layout."""
    from nanohlat.mesh import rank_of
    from nanohlat.plan import hardware
    for tp, pp, dp in itertools.product((1, 2, 3, 4), (1, 2, 3), (1, 2, 4, 5)):
        rings = hardware.dp_groups(tp, pp, dp)
        assert rings == [[rank_of(d, s, t, tp, dp) for d in range(dp)] for s in range(pp) for t in range(tp)]
        for rank in range(tp * pp * dp):
            assert Mesh(tp, pp, dp, rank).build_groups().group("dp").ranks in rings, (tp, pp, dp, rank)


def test_plan_says_where_the_dp_bytes_go():
    _, _, text = plan_in_seconds("hlat-7b")
    block = text[text.index("where the dp bytes go"):]
    assert "rank 0's dp ring 0 -> 8 -> 16 -> 24 -> ... -> 2040 -> 0 (256 hops)" in block
    row = next(line.split() for line in block.splitlines() if line.strip().startswith("NeuronCore-v2 "))
    assert row[1:6] == ["4", "192", "64", "8", "12.5"]


def test_recomputation_costs_a_third_with_full_checkpointing():
    model, train = recipe.parse_args(["--preset", "hlat-7b"])
    f = metrics.flops_per_token(model, 4096)
    assert plan.recompute_flops_per_token(model, 4096, "full") == pytest.approx(f / 3)
    assert plan.recompute_flops_per_token(model, 4096, "selective") == 4 * 32 * 4096 * 4096   # QK^T and AV
    assert plan.recompute_flops_per_token(model, 4096, "none") == 0


def test_plan_prints_a_time_estimate_with_its_assumptions_and_human_counts():
    _, _, text = plan_in_seconds("hlat-7b")
    assert "plan for preset hlat-7b: 6.74B parameters" in text
    assert "estimated time per step" in text and "assumptions:" in text
    assert "800 Gbps EFA" in text and "ASSUMPTION" in text
    _, _, text = plan_in_seconds("tiny", world=1)
    assert "plan for preset tiny: 250k parameters" in text


def test_search_ranks_layouts_that_fit_and_places_hlats_own(capsys):
    import train
    t0 = time.process_time()                   # CPU time: a busy machine does not count against it
    assert train.main(["--plan", "--search", "--preset", "hlat-7b", "--nproc", "2048"]) == 0
    assert time.process_time() - t0 < 15       # ~1.5 s on a 2-core development machine
    out = capsys.readouterr().out
    ranked = [line.split() for line in out.splitlines() if line.strip().split(" ")[0].isdigit()]
    assert len(ranked) >= 5
    assert [int(r[0]) for r in ranked] == list(range(1, len(ranked) + 1))
    assert "HLAT's own layout:" in out and ("ranks" in out)

    model, t = recipe.parse_args(["--preset", "hlat-7b"])
    rows = plan.search(model, t, 2048, "NeuronCore-v2")
    fits = [r for r in rows if r["fits"]]
    steps = [r["estimate"]["step"] for r in rows]
    assert steps == sorted(steps) and all(r["peak_memory"] <= 16 * 2**30 for r in fits)
    own = [r for r in rows if (r["t"].tp, r["t"].pp, r["t"].microbatches, r["t"].zero) == (8, 1, 4, 0)
           and r["t"].sequence_parallel and r["t"].activation_checkpointing == "selective"]
    assert len(own) == 1


def test_search_enumerates_every_valid_layout_of_a_small_case():
    """tiny (8 heads, 4 kv heads, 4 layers, batch 8) on 4 ranks: (tp, pp, dp) in
    (1,1,4) (1,2,2) (1,4,1) (2,1,2) (2,2,1) (4,1,1); micro-batches divide batch / dp;
    SP only with tp > 1, ZeRO stages 1 and 2 (and 3 at pp 1, on cpu and cuda) and overlapped
    reduction on or off (cpu, cuda) only with dp > 1; 3 checkpointing modes each. Overlap makes
    each dp > 1 step faster; ZeRO-3's all-gathers make it slower than ZeRO-2's."""
    model, t = recipe.parse_args(TINY + ["--device", "cpu"])
    layouts = list(plan.candidate_layouts(model, t, 4))
    per = {(1, 1, 4): 2 * 1 * 4 * 2, (1, 2, 2): 3 * 1 * 3 * 2, (1, 4, 1): 4, (2, 1, 2): 3 * 2 * 4 * 2,
           (2, 2, 1): 4 * 2, (4, 1, 1): 4 * 2}  # (divisors of batch/dp) x SP choices x ZeRO stages x overlap
    assert len(layouts) == 3 * sum(per.values())
    assert {(c.tp, c.pp, 4 // (c.tp * c.pp)) for c in layouts} == set(per)
    assert {(c.zero, c.overlap_grad_reduce) for c in layouts if c.tp * c.pp < 4} == \
        {(z, o) for z in (0, 1, 2, 3) for o in (True, False)}
    assert {c.pp for c in layouts if c.zero == 3} == {1}
    step = {layout_search._layout_name(c): plan.estimate_step(model, c, 4, "cpu")["step"] for c in layouts}
    for name, s in step.items():
        if name[-1] and name[0] * name[1] < 4:    # overlapped at dp > 1: faster than the same layout without
            assert s < step[name[:-1] + (False,)], name
        if name[3] == 3:                          # the same layout with ZeRO-2: less traffic, faster
            assert s > step[name[:3] + (2,) + name[4:]], name
    model, t = recipe.parse_args(TINY + ["--device", "xla"])      # XLA: nanohlat overlaps nothing, no ZeRO-3
    assert {(c.overlap_grad_reduce, c.zero) for c in plan.candidate_layouts(model, t, 4)} == \
        {(True, z) for z in (0, 1, 2)}


def test_the_older_zero1_spelling_leaves_the_search_and_the_memory_table_whole():
    """--zero1 is --zero 1, folded into the config once: the layouts the search copies from it
    still try every ZeRO stage, and the memory table's replicated column is still replicated."""
    model, t = recipe.parse_args(TINY + ["--device", "cpu", "--zero1"])
    _, t0 = recipe.parse_args(TINY + ["--device", "cpu"])
    assert (t.zero, t.zero1) == (1, False)
    assert {c.zero for c in plan.candidate_layouts(model, t, 4)} == {0, 1, 2, 3}
    assert [layout_search._layout_name(c) for c in plan.candidate_layouts(model, t, 4)] == \
        [layout_search._layout_name(c) for c in plan.candidate_layouts(model, dataclasses.replace(t0, zero=1), 4)]
    mem, mem0 = plan.memory_per_rank(model, t, 1, 1, 4, 0), plan.memory_per_rank(model, t0, 1, 1, 4, 0)
    assert mem["optimizer"] == mem["optimizer_zero1"] == mem0["optimizer_zero1"] < mem["optimizer_replicated"]
    assert mem["optimizer_replicated"] == mem0["optimizer_replicated"] == mem0["optimizer"]


def test_bubble_ideal_equals_the_formula_and_lockstep_ticks_cost_1f1b_more():
    """F = 1 and B = 2 units: a stage works 3m units of a 3(m + p - 1) step in both
    schedules; the runner's lock-step ticks pair 1F1B's forwards with backwards."""
    from nanohlat.beyond import schedules
    from nanohlat.tools import timeline
    for schedule in ("afab", "1f1b"):
        for pp, m in ((2, 4), (4, 8), (4, 16), (3, 5)):
            rows, span = timeline.ideal_timeline(schedule, pp, m)
            assert span == 3 * (m + pp - 1)
            assert all(sum(e - b for _, _, b, e, _ in ops) == 3 * m for ops in rows)
            assert timeline.ideal_bubble(schedule, pp, m) == pytest.approx(timeline.formula_bubble(pp, m))
    # pp 4, m 8: AFAB's ticks are all-F then all-B, 11 + 11 x 2 = 33 units; 1F1B's 22 ticks
    # hold a B in 16 of them: 6 x 1 + 16 x 2 = 40 units for the same 24 units of work per stage
    assert timeline.lockstep_bubble(schedules.timetable("afab", 4, 8), 8) == pytest.approx(1 - 24 / 33)
    assert timeline.lockstep_bubble(schedules.timetable("1f1b", 4, 8), 8) == pytest.approx(1 - 24 / 40)


def test_step_clock_records_ops_and_says_when_ranks_outnumber_cores(monkeypatch):
    from nanohlat.tools import timeline
    from nanohlat.device import get_device
    clock = timeline.StepClock(get_device("cpu"), synchronize=True)
    clock.start()
    t = clock.op_start()
    sum(range(10000))
    clock.op_end("F", 0, t, 1)
    clock.stop()
    (kind, i, b, e, c), = clock.records
    assert (kind, i, c) == ("F", 0, 1) and 0 <= b <= e <= clock.t1 - clock.t0
    assert 0 < clock.busy_fraction() <= 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(4 * (os.cpu_count() or 1)))
    assert "share" in timeline.oversubscription(get_device("cpu"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert timeline.oversubscription(get_device("cpu")) == ""


# -- the interleaved schedule in the plan ------------------------------------------

INTERLEAVED = TINY + ["--n-layers", "8", "--pp", "4", "--microbatches", "8", "--schedule", "interleaved",
                      "--virtual-stages", "2", "--device", "cpu"]


def test_plan_counts_interleaved_chunk_activations_exchanges_and_bubble():
    """pp 4, v 2, m 8, 8 layers: a middle stage holds 9 chunk activations of one
    layer each (1F1B's holds 3 micro-batches of two layers); rank 0 exchanges on
    boundary 0|1 (16 tensors each way) and on the wrap (8 each way); the bubble
    estimate is the pipeline's (p-1)/(v*m+p-1)."""
    model, t = recipe.parse_args(INTERLEAVED)
    one_f = dataclasses.replace(t, schedule="1f1b", virtual_stages=1)
    mem, mem_1f1b = plan.memory_per_rank(model, t, 1, 4, 1, 1), plan.memory_per_rank(model, one_f, 1, 4, 1, 1)
    assert mem["in_flight"] == 9 and mem_1f1b["in_flight"] == 3
    assert mem["activations"] == 9 * plan.activation_bytes(model, t, 1, 4, 1, 1)
    assert mem_1f1b["activations"] == 3 * plan.activation_bytes(model, one_f, 1, 4, 1, 1)
    x = 1 * 32 * 64 * 4                                         # one (mb, T, C) fp32 tensor
    comm = plan.comm_per_step(model, t, Mesh(1, 4, 1, 0))["pp.exchange"]
    assert comm["payload"] == (2 * 16 + 2 * 8) * x and comm["wire"] == (16 + 8) * x
    est = plan.estimate_step(model, t, 4, "cpu")
    assert est["bubble"] / est["pipeline"] == pytest.approx(3 / (2 * 8 + 3))
    text = plan.report(model, t, 4)
    assert "schedule interleaved (v=2 chunks per stage)" in text and "0-0,4-4" in text
    assert "the bubble is (p-1)/(v*m+p-1)" in text


def test_search_under_interleaved_keeps_only_layouts_it_allows():
    """Every pp > 1 candidate splits the 8 layers into pp*2 chunks and runs a
    multiple of pp micro-batches; pp 1 falls back to 1F1B."""
    model, t = recipe.parse_args(INTERLEAVED)
    layouts = list(plan.candidate_layouts(model, t, 4))
    assert {c.pp for c in layouts} == {1, 2, 4}
    for c in layouts:
        if c.pp == 1:
            assert (c.schedule, c.virtual_stages) == ("1f1b", 1)
        else:
            assert c.schedule == "interleaved" and 8 % (2 * c.pp) == 0 and c.microbatches % c.pp == 0


# -- the zb-h1 schedule in the plan ------------------------------------------------

ZB = TINY + ["--n-layers", "8", "--pp", "4", "--microbatches", "8", "--schedule", "zb-h1", "--device", "cpu"]


def test_plan_counts_zb_h1_micro_batches_from_forward_to_w_its_exchanges_and_bubble():
    """pp 4, m 8: every stage holds p = 4 micro-batches (1F1B: 4 3 2 1), whole
    until their B, then only what W needs; 1F1B's tensors cross the boundaries
    (a W sends nothing), in more ticks; the bubble estimate is (p-1)/(3m+p-1)."""
    model, t = recipe.parse_args(ZB)
    one_f = dataclasses.replace(t, schedule="1f1b")
    for stage in range(4):
        mem = plan.memory_per_rank(model, t, 1, 4, 1, stage)
        assert mem["in_flight"] == 4 and plan.memory_per_rank(model, one_f, 1, 4, 1, stage)["in_flight"] == 4 - stage
        full, left = plan.activation_bytes(model, t, 1, 4, 1, stage), plan.weight_grad_bytes(model, t, 1, 4, 1, stage)
        assert left < full
        # the order F0..F(p-1-s), then F B W...: the peak is after the F following the warm-up, with s
        # micro-batches past B (only W's share) and p - s whole
        assert mem["activations"] == (4 - stage) * full + stage * left
    # the same 2m tensors cross each boundary, but a W between them puts a stage's F and its
    # neighbour's B in different ticks more often: more exchange calls, each half padding
    assert plan.exchanges_per_boundary("zb-h1", 4, 8) == (16, 15, 14)
    assert plan.exchanges_per_boundary("1f1b", 4, 8) == (12, 11, 10)
    est = plan.estimate_step(model, t, 4, "cpu")
    assert est["bubble"] / est["pipeline"] == pytest.approx(3 / (3 * 8 + 3))
    text = plan.report(model, t, 4)
    assert "schedule zb-h1" in text and "the bubble is (p-1)/(3m+p-1)" in text and "4 mb: " in text


def test_exchanges_per_boundary_count_every_tick_that_moves_a_tensor():
    """Every schedule, pp 2 to 6, m up to 12 (interleaved: v 2 and 3): at each boundary the plan
    counts the ticks in which the left stage ran a forward (its activation crosses) or the right
    one a backward (its gradient crosses); interleaved adds the wrap boundary, where the last
    stage's forward of a chunk c < v-1 or the first stage's backward of a chunk c > 0 crosses:
    read here from the timetable op by op, beside the runner's rule that the plan calls."""
    from nanohlat.beyond.schedules import timetable

    def ran(op, kind, chunk=lambda c: True) -> bool:
        return op is not None and op[0] == kind and chunk(op[2])
    cases = 0
    for schedule in ("afab", "1f1b", "zb-h1", "interleaved"):
        for pp, m in itertools.product(range(2, 7), range(1, 13)):
            for v in ((2, 3) if schedule == "interleaved" else (1,)):
                if schedule == "interleaved" and m % pp or schedule == "zb-h1" and m < pp:
                    continue                      # (layouts recipe.check_layout refuses)
                ticks = timetable(schedule, pp, m, v)
                want = [sum(ran(row[b], "F") or ran(row[b + 1], "B") for row in ticks) for b in range(pp - 1)]
                if v > 1:
                    want.append(sum(ran(row[-1], "F", lambda c: c < v - 1) or ran(row[0], "B", lambda c: c > 0)
                                    for row in ticks))
                assert plan.exchanges_per_boundary(schedule, pp, m, v) == tuple(want), (schedule, pp, m, v)
                cases += 1
    assert cases > 150


@pytest.mark.parametrize("sp, regather", [(False, True), (True, True), (True, False)])
def test_weight_grad_bytes_are_what_the_split_backward_stashes(sp, regather):
    """weight_grad_bytes against the tensors B really leaves for W (tp 1, one
    process; with sequence parallel at tp 1 nothing is gathered): every distinct
    tensor in a split_backward.SplitBackward's stash, on the last stage (head too)
    and a middle one."""
    from nanohlat.beyond import split_backward
    from nanohlat.model import Transformer, init_weights
    model_cfg, t = recipe.parse_args(ZB + (["--sequence-parallel"] if sp else []) + ([] if regather else ["--no-sp-regather"]))
    mb = plan.micro_batch_size(t, 1)
    for stage, first, last in ((3, False, True), (1, False, False)):
        layers = range(2 * stage, 2 * stage + 2)
        model = Transformer(model_cfg, layers=layers, first=first, last=last)
        split_backward.apply(model)
        init_weights(model, 0)
        x = torch.randn(mb, t.seq_len, model_cfg.d_model, requires_grad=True)
        with split_backward.SplitBackward(model) as deferring:
            out = model(x, torch.zeros(mb, t.seq_len, dtype=torch.long)) if last else model(x)
            out.sum().backward()
            stash = deferring.stash
        kept = {id(a): a for _, x_in, _, grads in stash for a in (x_in, *grads)}
        assert sum(a.nbytes for a in kept.values()) == plan.weight_grad_bytes(model_cfg, t, 1, 4, 1, stage)


def test_search_under_zb_h1_keeps_at_least_a_micro_batch_per_stage_and_no_zero2():
    model, t = recipe.parse_args(ZB)
    layouts = list(plan.candidate_layouts(model, t, 4))
    assert {c.pp for c in layouts} == {1, 2, 4}
    assert all(c.schedule == "zb-h1" and c.microbatches >= c.pp and c.zero != 2 for c in layouts)
