"""The plan of a mixture of experts at every --ep (the standards: plan_utils.py): what rank 0 holds
and sends at ep 1 and 2, at ep 4 and ep 2 of dp 4 (and pp 2 x ep 2 under ZB-H1), to the byte,
routing forced balanced (`_balanced_routing`); the plan's total and active parameters and its
all-to-alls; the search over every ep, its rows the plan's figures; hlat-moe at ep 8 on 2048 ranks
in seconds. (The mixture in the other layouts: test_plan_moe.py.)"""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from nanohlat import recipe
from nanohlat import plan
from nanohlat.mesh import Mesh
from plan_utils import TINY, _balanced_routing, assert_run_matches_plan, llama_params


# ---------------------------------------------------------------------------
# 2c'. A mixture of experts: its bytes per rank at ep 1 and 2, its all-to-alls
# ---------------------------------------------------------------------------

MOE_LAYOUTS2 = {"dp2_zero1": ["--dp", "2", "--zero", "1"], "ep2": ["--ep", "2"],
                "ep2_full_m2": ["--ep", "2", "--activation-checkpointing", "full", "--microbatches", "2"],
                "ep2_every2_shared": ["--ep", "2", "--moe-every", "2", "--moe-shared-experts", "1"],
                "ep2_capacity_full": ["--ep", "2", "--moe-capacity-factor", "1.25", "--activation-checkpointing", "full"]}


def _moe_runs_match_the_plan(layouts: dict, world: int, cache_dir, tmp_path) -> dict:
    """Train each layout of the moe preset 1 step on `world` gloo ranks (one group of workers, routing
    forced balanced); assert rank 0's bytes and ledger equal the plan; returns name -> argv."""
    from dist_utils import run_layouts
    base = ["--preset", "moe", "--steps", "1", "--eval-every", "0", "--device", "cpu", "--cache-dir", cache_dir,
            "--no-progress", "--threads", "1"]
    runs = {name: base + ["--out-dir", str(tmp_path / name)] + extra for name, extra in layouts.items()}
    run_layouts(world, list(runs.values()), str(tmp_path / "errors"), setup=_balanced_routing)
    for name, argv in runs.items():
        assert_run_matches_plan(tmp_path / name, argv, world)
    return runs


@pytest.mark.slow
def test_moe_plan_equals_what_ranks_hold_and_send_at_ep_1_and_2(cache_dir, tmp_path):
    """The moe preset on 2 gloo ranks, 1 step, routing forced balanced: rank 0's parameter, fp32
    gradient and Adam bytes (experts replicated at ep 1, padded under ZeRO-1; E/ep of them at ep 2)
    and its comm ledger, all-to-alls included, equal the plan to the byte."""
    runs = _moe_runs_match_the_plan(MOE_LAYOUTS2, 2, cache_dir, tmp_path)
    model, train = recipe.parse_args(runs["ep2"])
    E, k, N = model.moe_experts, model.moe_top_k, train.batch_size // 2 * train.seq_len
    got = plan.comm_per_step(model, train, Mesh(1, 1, 2, 0))["ep.all_to_all"]
    assert got["calls"] == 5 * model.n_layers and got["payload"] == model.n_layers * (8 * E + 4 * N * k * 64 * 4)
    with open(tmp_path / "ep2" / "summary.json") as f:
        held = json.load(f)["param_bytes"] // 4
    assert held == model.num_params() - model.n_layers * E // 2 * 3 * model.d_model * model.ffn_dim


MOE_LAYOUTS4 = {"ep4": ["--ep", "4"], "ep2_of_dp4": ["--ep", "2"],     # dp 4: ep_dp groups of 1 and of 2
                "ep4_zero1": ["--ep", "4", "--zero", "1"], "ep2_of_dp4_zero1": ["--ep", "2", "--zero", "1"],
                # each stage's all-to-alls for its own sparse layers (1 of its 2)
                "pp2_ep2_zbh1_every2": ["--pp", "2", "--ep", "2", "--microbatches", "2", "--schedule", "zb-h1",
                                        "--moe-every", "2"]}


@pytest.mark.slow
def test_moe_plan_equals_what_ranks_hold_and_send_at_ep_4_and_ep_2_of_dp_4(cache_dir, tmp_path):
    """The same at dp 4 (4 gloo ranks, one group of workers, 1 step each, routing forced balanced),
    and at pp 2 x dp 2 with --ep 2 under ZB-H1, every other layer sparse: --ep 4 (each rank 1 of the 4 experts, no other rank holding it: no ep_dp sum) and --ep 2 (2
    experts a rank, their gradients summed over the ep_dp group of the 2 ranks holding the same
    ones, [0 2] and [1 3]), each without and with ZeRO-1 (the dense state sharded over dp 4, the
    experts' over their ep_dp group: unsharded at ep 4, halves at ep 2): rank 0's bytes and its
    whole ledger equal the plan."""
    runs = _moe_runs_match_the_plan(MOE_LAYOUTS4, 4, cache_dir, tmp_path)
    model, _ = recipe.parse_args(runs["ep4"])
    mlp = 3 * model.d_model * model.ffn_dim
    with open(tmp_path / "ep4" / "summary.json") as f:
        ep4 = json.load(f)
    with open(tmp_path / "ep2_of_dp4" / "summary.json") as f:
        ep2 = json.load(f)
    assert ep4["param_bytes"] // 4 == model.num_params() - model.n_layers * 3 * mlp      # 1 of 4 experts a layer
    assert ep2["param_bytes"] // 4 == model.num_params() - model.n_layers * 2 * mlp      # 2 of 4
    assert not any(k.startswith("ep_dp.") for k in ep4["comm_bytes"])                   # ep_dp of 1 rank: no sum
    assert ep2["comm_bytes"]["ep_dp.all_reduce"] == 4 * model.n_layers * 2 * mlp         # its 2 experts' fp32 grads
    with open(tmp_path / "ep2_of_dp4_zero1" / "summary.json") as f:
        z = json.load(f)
    assert z["comm_bytes"]["ep_dp.reduce_scatter"] == 4 * model.n_layers * 2 * mlp and "ep.all_reduce" not in z["comm_bytes"]


def test_moe_plan_prints_total_and_active_parameters_and_its_all_to_alls(capsys):
    import train
    assert train.main(["--plan", "--preset", "moe", "--nproc", "2", "--ep", "2"]) == 0
    out = capsys.readouterr().out
    model, _ = recipe.parse_args(["--preset", "moe"])
    active = model.num_params() - model.moe_extra_params() + model.moe_extra_params(active=True)
    from nanohlat.plan.fmt import fmt_count
    assert active < model.num_params()
    assert f"{fmt_count(model.num_params())} parameters in all, {fmt_count(active)} active per token" in out
    for text in ("E/ep = 2 expert(s)", "ep.all_to_all", "PREDICTED FOR BALANCED ROUTING", "ep all-to-all",
                 "on its active parameters"):
        assert text in out, text
    # every layout it trains with, it plans
    for flags in (["--zero", "3"], ["--ep", "2", "--zero", "2"], ["--tp", "2", "--sequence-parallel"],
                  ["--pp", "2", "--schedule", "zb-h1", "--microbatches", "2"], ["--cp", "2"], ["--cp", "2", "--ep", "2"]):
        assert train.main(["--plan", "--preset", "moe", "--nproc", "2"] + flags) == 0, flags


def _search_rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line.strip().split(" ")[0].isdigit()]


def test_moe_search_tries_every_ep_and_its_rows_are_the_plans_figures(capsys):
    """--plan --search --preset moe on 8 cpu ranks (gloo's stated 1 GB/s and 50 us a call) tries
    every layout the mixture trains with: tp, pp, ZeRO 0-3 and ep 1, 2 and 4 (the divisors of dp
    that divide the 4 experts); every printed row's peak memory and step are plan.memory_per_rank's
    and estimate_step's for the layout its columns name.
    At tp 1, pp 1, ep 4 wins here: at ep 1 every rank all-reduces every expert's fp32 gradient over dp 8 (4
    layers x 4 experts x 3 x 64 x 128 x 4 B = 1.5 MiB, at 1 GB/s), at ep 4 only its one expert's,
    over the ep_dp pair holding it, for 5 all-to-alls a layer of 32 tokens x 2 choices x 64 x 4 B
    (8 KiB each: the 50 us calls cost more than the bytes). On NeuronCores, whose links are ~100
    times faster and whose calls cost as much, those calls are what a step spends: ep 1 wins."""
    import train
    from nanohlat.plan.fmt import fmt_bytes, fmt_seconds
    argv = ["--preset", "moe", "--device", "cpu"]
    assert train.main(["--plan", "--search", "--nproc", "8"] + argv) == 0
    out = capsys.readouterr().out
    header = next(line.split() for line in out.splitlines() if line.strip().startswith("#  tp"))
    assert header[:8] == ["#", "tp", "pp", "cp", "cp", "attn", "dp", "ep"]
    rows = _search_rows(out)
    assert len(rows) == 10 and {r[6] for r in rows} >= {"1", "4"} and {r[1] for r in rows} > {"1"}
    model, _ = recipe.parse_args(argv)
    for r in rows:
        tp, pp, dp = int(r[1]), int(r[2]), int(r[5])
        assert r[3:5] == ["1", "-"] and tp * pp * dp == 8
        flags = argv + ["--tp", r[1], "--pp", r[2], "--ep", r[6], "--microbatches", r[7],
                        "--zero", "0" if r[8] == "-" else r[8], "--activation-checkpointing", r[10]] \
            + (["--sequence-parallel"] if r[9] == "yes" else []) \
            + (["--no-overlap-grad-reduce"] if r[-1] == "-" else [])
        _, t = recipe.parse_args(flags)
        assert t.overlap_grad_reduce == (r[-1] == "on")
        peak = max(plan.memory_per_rank(model, t, tp, pp, dp, s, fused=True, eager=True)["peak"] for s in {0, pp - 1})
        assert " ".join(r[11:13]) == fmt_bytes(peak)
        est = plan.estimate_step(model, t, 8, "cpu")
        assert " ".join(r[-5:-3]) == fmt_seconds(est["step"]), r
        comm = plan.comm_per_step(model, t, Mesh(tp, pp, dp, 0))
        assert ("ep.all_to_all" in comm) == (t.ep > 1)
    model, t = recipe.parse_args(argv)
    layouts = list(plan.candidate_layouts(model, t, 8))
    assert {(c.ep, c.zero) for c in layouts} == {(e, z) for e in (1, 2, 4) for z in range(4)}
    assert {(c.tp, c.pp) for c in layouts} >= {(2, 1), (1, 2), (2, 2), (8, 1), (1, 4)}
    for device, wins in (("cpu", lambda b: b[4] < b[2] < b[1]), ("NeuronCore-v2", lambda b: b[1] < min(b[2], b[4]))):
        best = {}
        for c in layouts:
            if (c.tp, c.pp) == (1, 1):
                best[c.ep] = min(best.get(c.ep, float("inf")), plan.estimate_step(model, c, 8, device)["step"])
        assert wins(best), (device, best)
    # a dense model's table keeps its columns: no ep
    assert train.main(["--plan", "--search", "--nproc", "4"] + TINY + ["--device", "cpu"]) == 0
    assert "  #  tp  pp  cp  cp attn  dp  m  ZeRO  SP" in capsys.readouterr().out


def test_hlat_moe_plans_at_ep_8_on_2048_ranks_in_seconds():
    """hlat-7b's shape, every MLP 8 experts of its ffn 11008, top-2, fp32, dp 2048 with --ep 8:
    37.0B parameters, 11.1B active; a rank holds 1 of each layer's 8 experts."""
    model, train = recipe.parse_args(["--preset", "hlat-moe", "--ep", "8"])
    d, f, L = 4096, 11008, 32
    dense = llama_params(L, d, 32, 32, f, 32000)
    assert model.num_params() == dense + L * (7 * 3 * d * f + 8 * d)                 # + 7 more MLPs, the router
    t0 = time.perf_counter()
    text = plan.report(model, train, 2048)
    assert time.perf_counter() - t0 < 5
    held = dense + L * 8 * d                                                          # one expert + the router
    mem = plan.memory_per_rank(model, train, 1, 1, 2048, 0)
    assert mem["params"] == held and mem["weights"] == 4 * held and mem["optimizer"] == 8 * held
    assert "37B parameters in all, 11.1B active per token" in text and "E/ep = 1 expert(s)" in text
    comm = plan.comm_per_step(model, train, Mesh(1, 1, 2048, 0))
    N = 2048 // 2048 * 4096                                                           # tokens per rank
    assert comm["ep.all_to_all"]["payload"] == L * (8 * 8 + 4 * N * 2 * d * 4)
    assert sum(v["payload"] for k, v in comm.items() if k.startswith("ep_dp.")) == 4 * L * 3 * d * f   # over 256
    # fewer gradient bytes at ep 8 (1 expert's over its ep_dp ring of 256, 8 such rings at once, walked hop by
    # hop as the dp ring is) than at ep 1 (all 8 experts' over the dp ring of 2048): less dp time
    ep1 = dataclasses.replace(train, ep=1)
    assert plan.estimate_step(model, train, 2048, "NeuronCore-v2")["comm"]["dp"] < \
        plan.estimate_step(model, ep1, 2048, "NeuronCore-v2")["comm"]["dp"]
