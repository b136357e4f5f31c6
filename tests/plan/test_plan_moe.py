"""The plan of a mixture of experts (nanohlat/plan/) in every layout it trains with:
tp 2 with sequence parallelism, pp 2 under 1F1B and ZB-H1, ZeRO-3, --ep 2 with ZeRO-2, and cp 2
(ring attention), alone and with --ep 2 drawn from dp x cp (dp 1: the two cp ranks share the experts).

Held to the standards a dense model's plan is held to (tests/plan/plan_utils.py): what one sparse block keeps
for backward, counted tensor by tensor, to the byte; a run's comm ledger of its first step and its
bytes per rank (weights, fp32 gradients, Adam state) to the byte; the allocator's peak bounded from
above, at most PEAK_MARGIN below the plan's. Routing is forced balanced in the runs (what the plan
predicts the all-to-alls and the --ep dispatch for, plan_utils._balanced_routing)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from dist_utils import spawn_workers
from nanohlat.beyond import moe
from nanohlat import recipe
from nanohlat import plan
from plan_utils import LiveBytes, _balanced_routing, _peak_worker, assert_run_matches_plan


@pytest.mark.parametrize("factor, shared, dtype, B", [(0.0, 0, torch.float32, 16), (1.25, 0, torch.bfloat16, 8),
                                                      (0.0, 1, torch.bfloat16, 8), (0.0, 0, torch.float32, 8)],
                         ids=["per-slice", "capacity", "shared", "grouped"])
def test_a_sparse_block_keeps_what_the_plan_counts_to_the_byte(factor, shared, dtype, B):
    """One moe.MoE block of the moe preset's shape (B sequences of 32 tokens, 4 experts of ffn 128, top-2):
    the bytes autograd keeps after its forward (LiveBytes: every storage made inside, still alive; its
    output's left out) are plan.moe_layer_bytes's: the router's fp32 tensors (and in bf16 its fp32 copies
    of the input and weight), the dispatch's indices, rows and SwiGLU intermediates, the shared expert's.
    At B = 8 in fp32 each expert's slice (128 rows) is small enough for moe.grouped's one grouped matmul
    (torch >= 2.10: plan.moe_grouped says so, and the plan adds its side-by-side gate and up weights; older
    torch: one matmul per slice); at B = 16 (256 rows) it is not, in bf16 never."""
    cfg = recipe.PRESETS["moe"][0]
    block = moe.MoE(cfg.d_model, cfg.ffn_dim, cfg.moe_experts, cfg.moe_top_k, shared, factor, aux_coef=0.01,
                    z_coef=0.001, loss_scale=0.125).to(dtype)
    x = torch.randn(B, 32, cfg.d_model, dtype=dtype, requires_grad=True)
    existing = {t.untyped_storage().data_ptr() for t in [*block.parameters(), x]}
    with LiveBytes(existing) as live:
        y = block(x)
    kept = live.alive() - y.numel() * y.element_size()
    cfg = dataclasses.replace(cfg, moe_capacity_factor=factor, moe_shared_experts=shared)
    on_cpu = recipe.parse_args(["--preset", "moe", "--device", "cpu"])[1]
    grouped = plan.moe_grouped(cfg, on_cpu, B * 32, dtype.itemsize)
    assert grouped == (B == 8 and dtype == torch.float32 and hasattr(torch.nn.functional, "grouped_mm"))
    assert kept == plan.moe_layer_bytes(cfg, B * 32, B, dtype.itemsize, grouped=grouped)


# 2 gloo ranks, 3 steps each under the allocator's watch (plan_utils.allocator_peak): name -> flags
MOE_LAYOUTS = {"tp 2 SP": ["--tp", "2", "--sequence-parallel"],
               "tp 2 SP full": ["--tp", "2", "--sequence-parallel", "--activation-checkpointing", "full"],
               "pp 2 1f1b": ["--pp", "2", "--microbatches", "4", "--schedule", "1f1b"],
               "pp 2 zb-h1": ["--pp", "2", "--microbatches", "4", "--schedule", "zb-h1"],
               "ZeRO-3 dp 2": ["--dp", "2", "--zero", "3"],
               "ep 2 ZeRO-2": ["--ep", "2", "--zero", "2", "--microbatches", "2"],
               "cp 2 ring": ["--cp", "2", "--cp-attention", "ring"],
               "cp 2 x ep 2": ["--cp", "2", "--ep", "2"]}


def _worker(rank, world, runs, out_dir):
    _balanced_routing(rank)
    _peak_worker(rank, world, runs, out_dir)


@pytest.fixture(scope="module")
def moe_runs(cache_dir, tmp_path_factory):
    """name -> (argv, its out-dir, [(rank, stage, allocator peak, plan's peak)]): each of MOE_LAYOUTS
    trained 3 steps by one group of 2 workers (starting them is most of the cost)."""
    root = tmp_path_factory.mktemp("plan_moe")
    base = ["--preset", "moe", "--steps", "3", "--eval-every", "0", "--device", "cpu", "--cache-dir", cache_dir]
    runs = [base + extra for extra in MOE_LAYOUTS.values()]
    spawn_workers(_worker, 2, (runs, str(root)), str(root / "errors"))
    results = {r: json.load(open(root / f"peaks{r}.json")) for r in range(2)}
    return {name: (runs[i], os.path.join(root, f"run{i}"), [(r, *results[r][i]) for r in range(2)])
            for i, name in enumerate(MOE_LAYOUTS)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_moe_plan_equals_the_ledger_and_bounds_the_allocator_peak(moe_runs, name):
    """Rank 0's first-step comm ledger (payload, wire, padding and calls of every collective: tp's
    without the sparse blocks' MLP collectives, with their router sums under SP and their gradients'
    sum over tp; pp's exchanges; ZeRO-3's gathers of every unit, the sparse layers' larger; ep's
    all-to-alls and the experts' reduce-scatters over their ep_dp pair; cp's attention exchanges and
    the router sums over the cp ranks, and at cp 2 x ep 2 the all-to-alls of T/cp tokens a rank) and
    its bytes per rank equal the plan's; on every rank, measured <= plan <= (1 + PEAK_MARGIN) x measured."""
    argv, out_dir, peaks = moe_runs[name]
    assert_run_matches_plan(out_dir, argv, 2)
    for rank, stage, measured, planned in peaks:
        print(f"moe {name}: rank {rank} stage {stage}: plan / measured {planned / measured:.3f}")   # (-s shows them)
        assert measured <= planned <= (1 + plan.PEAK_MARGIN) * measured, \
            (name, rank, stage, measured, planned, round(planned / measured, 4))


@pytest.mark.slow
def test_hlat_moe_search_prints_its_table_and_names_its_layout(capsys):
    """hlat-moe on 2048 NeuronCores: every layout that trains is searched (tp, pp, ZeRO 0-3, ep), some fit
    16 GiB, and the preset's own layout is called that (HLAT trained no mixture of experts)."""
    import train
    assert train.main(["--plan", "--search", "--preset", "hlat-moe", "--nproc", "2048"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip().split(" ")[0].isdigit()]
    assert len(rows) == 10 and "the preset's own layout:" in out and "HLAT's own layout" not in out
    assert any(r[1] != "1" for r in rows) or any(r[2] != "1" for r in rows)   # tp or pp: not only tp 1 pp 1


def test_moe_search_tries_cp_and_draws_ep_from_dp_x_cp():
    """--search with --cp 4 given (a dense model's rule: cp is tried for long sequences or when asked, down
    to the tokens a rank keeps at the cp asked) tries a mixture at cp 2 and 4 too, with every ep dividing dp x cp and the experts: at cp 4 and dp 1 on 4
    ranks, ep 2 and 4 (the cp ranks share the experts); each such layout is planned and estimated."""
    model, t = recipe.parse_args(["--preset", "moe", "--device", "cpu", "--cp", "4"])
    layouts = [c for c in plan.candidate_layouts(model, t, 4) if (c.tp, c.pp) == (1, 1)]
    assert {(c.cp, c.ep) for c in layouts} == {(cp, ep) for cp in (1, 2, 4) for ep in (1, 2, 4)}
    rows = plan.search(model, t, 4, "cpu")
    assert any(r["t"].cp == 4 and r["t"].ep == 4 and r["estimate"]["comm"]["ep"] > 0 for r in rows)
