"""The plan's bytes and calls against small real runs (tiny preset, CPU, gloo; the standards:
plan_utils.py): the bytes autograd keeps after a forward, counted tensor by tensor, in one process
and at tp 2 x pp 2 with and without sequence parallelism; four ranks' and two ranks' comm ledgers,
optimizer state and micro-batches in flight, to the byte, and what the wire figures teach (tutorial
chapters 3-5); one process's optimizer state and micro-batches in flight."""

from __future__ import annotations

import json
import os

import pytest

from dist_utils import spawn_workers
from nanohlat import plan, recipe
from nanohlat.run import preflight
from nanohlat.mesh import Mesh
from plan_utils import BASE, TINY, assert_run_matches_plan, close, forward_bytes


# ---------------------------------------------------------------------------
# 2a. Activations: the bytes autograd keeps, counted tensor by tensor
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("pp,stage", [(1, 0), (2, 0), (4, 1), (2, 1)], ids=["whole", "first", "middle", "last"])
def test_activation_bytes_match_autograd(precision, mode, pp, stage):
    measured, planned = forward_bytes(TINY + ["--precision", precision, "--activation-checkpointing", mode],
                                      pp=pp, stage=stage)
    assert close(measured, planned), (measured, planned)


def test_the_plan_counts_the_kv_copies_on_cuda_only():
    """model.attention_core copies grouped-query kv heads out to one per query head on CUDA only (its
    fp32 fused kernel takes no grouped heads): the plan adds those copies there, k and v at H heads
    instead of K, 2 x 4 bytes x mb T (H - K) D a layer, and not on the CPU, whose bytes the test above
    holds to autograd's."""
    (cfg, cpu), (_, cuda) = (recipe.parse_args(TINY + ["--device", d]) for d in ("cpu", "cuda"))
    assert cfg.n_kv_heads < cfg.n_heads
    copies = cfg.n_layers * 2 * 4 * cpu.batch_size * cpu.seq_len * (cfg.n_heads - cfg.n_kv_heads) * cfg.head_dim
    assert plan.activation_bytes(cfg, cuda, 1, 1, 1, 0) - plan.activation_bytes(cfg, cpu, 1, 1, 1, 0) == copies


# ---------------------------------------------------------------------------
# 2b. Four ranks: comm ledger, optimizer state, micro-batches in flight; tp/sp activations
# ---------------------------------------------------------------------------


LAYOUTS4 = {   # 4 ranks; rank 0 is tp 0, dp 0 of stage 0
    "tp2_pp2_sp_full_1f1b": ["--tp", "2", "--pp", "2", "--sequence-parallel", "--microbatches", "2",
                             "--activation-checkpointing", "full"],
    "tp2_dp2_zero1_bf16mixed": ["--tp", "2", "--dp", "2", "--zero1", "--precision", "bf16-mixed",
                                "--activation-checkpointing", "selective", "--bucket-mb", "0.01"],
    "pp2_dp2_afab_bf16sr": ["--pp", "2", "--dp", "2", "--schedule", "afab", "--microbatches", "4",
                            "--precision", "bf16-sr"],
    # a replicated kv head (tp 2 > 1 kv head) in its own flat group; ZeRO-1 with bf16 moments
    "tp2_dp2_kv1_zero1_bf16sr_moments": ["--tp", "2", "--dp", "2", "--n-kv-heads", "1", "--zero1",
                                         "--precision", "bf16-sr", "--moments", "bf16"],
}


def _four_rank_worker(rank, world, train_runs, activation_runs, out_dir):
    """One of 4 gloo ranks: train each of `train_runs` (train.py writes summary.json),
    then, on a tp 2 x pp 2 mesh, measure each of `activation_runs` on this rank's stage."""
    import train
    from nanohlat import comm
    from nanohlat.device import get_device
    for argv in train_runs:
        train.train(*preflight.inputs(*recipe.parse_args(argv + ["--no-progress", "--threads", "1"]), world, rank))
    mesh = Mesh(2, 2, 1, rank, ledger=comm.CommLedger()).build_groups(get_device("cpu"))
    results = [forward_bytes(argv, mesh.tp_group, pp=2, stage=mesh.pp_rank) for argv in activation_runs]
    with open(os.path.join(out_dir, f"activations{rank}.json"), "w") as f:
        json.dump(results, f)


ACTIVATION_RUNS = [TINY + ["--tp", "2", "--pp", "2", "--precision", p, "--activation-checkpointing", m] + sp
                   for p in ("fp32", "bf16-mixed") for m in ("none", "selective", "full")
                   for sp in ([], ["--sequence-parallel"], ["--sequence-parallel", "--no-sp-regather"])]


@pytest.fixture(scope="module")
def four_ranks(cache_dir, tmp_path_factory):
    """One group of 4 gloo workers (starting them is most of the cost) runs
    every 4-rank measurement. Returns (train argv by name, activation results by rank)."""
    root = tmp_path_factory.mktemp("plan4")
    runs = {name: BASE + ["--cache-dir", cache_dir, "--out-dir", str(root / name)] + extra
            for name, extra in LAYOUTS4.items()}
    spawn_workers(_four_rank_worker, 4, (list(runs.values()), ACTIVATION_RUNS, str(root)), str(root / "errors"))
    activations = {}
    for rank in range(4):
        with open(root / f"activations{rank}.json") as f:
            activations[rank] = json.load(f)
    return runs, activations


@pytest.mark.parametrize("name", list(LAYOUTS4))
@pytest.mark.slow
def test_comm_optimizer_and_in_flight_match_a_four_rank_run(four_ranks, name):
    argv = four_ranks[0][name]
    assert_run_matches_plan(argv[argv.index("--out-dir") + 1], argv, 4)


@pytest.mark.parametrize("i", range(len(ACTIVATION_RUNS)),
                         ids=[" ".join(a[6:]).replace("--", "") for a in ACTIVATION_RUNS])
@pytest.mark.slow
def test_activation_bytes_match_autograd_with_tensor_and_sequence_parallel(four_ranks, i):
    """tp 2 x pp 2: ranks 0, 1 measure the first stage, ranks 2, 3 the last."""
    for rank, results in four_ranks[1].items():
        measured, planned = results[i]
        assert close(measured, planned), (rank, measured, planned)


# ---------------------------------------------------------------------------
# 2b'. Two ranks: what the wire figures teach (tutorial chapters 3-5)
# ---------------------------------------------------------------------------

LAYOUTS2 = {"dp": ["--dp", "2"], "dp_zero1": ["--dp", "2", "--zero1"],
            "tp": ["--tp", "2"], "tp_sp": ["--tp", "2", "--sequence-parallel"],
            "tp_sp_kept": ["--tp", "2", "--sequence-parallel", "--no-sp-regather"],
            "pp_afab": ["--pp", "2", "--microbatches", "4", "--schedule", "afab"],
            "pp_1f1b": ["--pp", "2", "--microbatches", "4", "--schedule", "1f1b"]}


@pytest.fixture(scope="module")
def two_ranks(cache_dir, tmp_path_factory):
    """summary.json of a 1-step run of each of LAYOUTS2, all in one group of 2 workers."""
    from dist_utils import run_layouts
    root = tmp_path_factory.mktemp("plan2")
    runs = {name: BASE + ["--cache-dir", cache_dir, "--out-dir", str(root / name)] + extra
            for name, extra in LAYOUTS2.items()}
    run_layouts(2, list(runs.values()), str(root / "errors"))
    out = {}
    for name, argv in runs.items():
        with open(root / name / "summary.json") as f:
            out[name] = json.load(f)
        assert_run_matches_plan(root / name, argv, 2)
    return out


def wire_total(summary: dict) -> int:
    return sum(summary["comm_wire_bytes"].values())


def test_zero1_puts_on_the_wire_what_data_parallel_does(two_ranks):
    """Reduce-scatter + all-gather = one all-reduce on the wire; ZeRO-1 adds only
    the 4-byte grad-norm scalar (each rank's shard norm must be summed)."""
    dp, zero = two_ranks["dp"], two_ranks["dp_zero1"]
    grads = 4 * 250_432                    # tiny's fp32 gradients, both flat groups
    # dp 2: an all-reduce of S sends 2 (n-1)/n S = S per rank, here the gradients and the loss
    assert dp["comm_wire_bytes"] == {"dp.all_reduce": grads + 4}
    # ZeRO-1: reduce-scatter (n-1)/n of the fp32 gradients, all-gather (n-1)/n of the fp32 weights
    assert zero["comm_wire_bytes"] == {"dp.reduce_scatter": grads // 2, "dp.all_gather": grads // 2,
                                       "dp.all_reduce": 4 + 4}
    assert wire_total(zero) == wire_total(dp) + 4
    # while the payload, the old "buffer" count, doubles
    assert sum(zero["comm_bytes"].values()) == 2 * grads + 8


def test_sequence_parallel_puts_on_the_wire_what_tensor_parallel_does(two_ranks):
    """Each all-reduce becomes an all-gather + a reduce-scatter of the same tensor:
    8 collectives per layer instead of 4, each moving half as much. SP keeping
    its gathers (--no-sp-regather) adds only the all-reduce of the norm
    weights' gradients (each rank saw its own tokens); re-gathering in backward
    (--sp-regather, the default) adds one all-gather per norm: 2 per layer and
    the head's."""
    tp, sp, regather = two_ranks["tp"], two_ranks["tp_sp_kept"], two_ranks["tp_sp"]
    act = 8 * 32 * 64 * 4                  # (mb, T, C) fp32
    layers = 4
    assert tp["comm_calls"]["tp.all_reduce"] - sp["comm_calls"]["tp.all_reduce"] == 4 * layers + 2 - 1
    assert sp["comm_calls"]["tp.reduce_scatter"] == 4 * layers + 2     # 4 per layer + embedding + head
    norms = 4 * (2 * layers * 64 + 64)     # fp32 gradients of the replicated norm weights
    assert wire_total(sp) == wire_total(tp) + norms
    # all-gathers and reduce-scatters of (mb, T, C), each sending half of it, and the loss's maxima
    maxima = 2 * 8 * 32 * 4
    assert sp["comm_wire_bytes"]["tp.all_gather"] + sp["comm_wire_bytes"]["tp.reduce_scatter"] \
        == 2 * (4 * layers + 2) * act // 2 + maxima // 2
    assert regather["comm_calls"]["tp.all_gather"] - sp["comm_calls"]["tp.all_gather"] == 2 * layers + 1
    assert wire_total(regather) == wire_total(sp) + (2 * layers + 1) * act // 2


def test_exchange_padding_is_reported_apart_from_the_payload(two_ranks):
    """AFAB and 1F1B move the same real tensors; 1F1B only wastes fewer zeros."""
    afab, f1b = two_ranks["pp_afab"], two_ranks["pp_1f1b"]
    x = 2 * 32 * 64 * 4                    # one micro-batch of 2 sequences, fp32
    for run in (afab, f1b):
        assert run["comm_bytes"]["pp.exchange"] == 2 * 4 * x       # 4 activations out, 4 gradients in
        assert run["comm_wire_bytes"]["pp.exchange"] == 4 * x
    # AFAB: forwards and backwards never share a tick: 8 exchanges, half of each side zeros
    assert afab["comm_calls"]["pp.exchange"] == 8 and afab["comm_padding_bytes"]["pp.exchange"] == 4 * x
    # 1F1B on 2 stages: the steady state (stage 0: B0 F2 B1 F3, stage 1: F1 B1 F2 B2) sends an
    # activation and a gradient in one exchange: 6 exchanges, 2 of them with a zero tensor
    assert f1b["comm_calls"]["pp.exchange"] == 6 and f1b["comm_padding_bytes"]["pp.exchange"] == 2 * x


# ---------------------------------------------------------------------------
# 2c. One process: optimizer state and micro-batches in flight
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [["--microbatches", "2"], ["--precision", "bf16-sr"], ["--precision", "bf16"],
                                   ["--precision", "bf16-mixed"], ["--precision", "bf16-sr", "--moments", "bf16"]])
def test_optimizer_and_in_flight_match_a_one_process_run(cache_dir, tmp_path, extra):
    import train
    argv = BASE + ["--cache-dir", cache_dir, "--out-dir", str(tmp_path), "--no-progress"] + extra
    train.train(*preflight.inputs(*recipe.parse_args(argv)))
    assert_run_matches_plan(tmp_path, argv, 1)
