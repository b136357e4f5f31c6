"""The plan at full scale, by hand (the standards: plan_utils.py): HLAT-7B on 2048 NeuronCores and
HLAT-70B at tp 32, pp 8 with ZeRO-1 plan in seconds, with LLaMA-2's parameter counts, each rank's
bytes and the sequence-parallel all-gathers worked out; HLAT's layouts leave 2 GiB of a NeuronCore;
`--plan` prints and returns before any data or worker."""

from __future__ import annotations

import re

import pytest

from nanohlat import recipe
from nanohlat.tools import metrics
from nanohlat import plan
from nanohlat.mesh import Mesh
from plan_utils import llama_params, plan_in_seconds


def test_hlat_7b_on_2048_neuroncores_plans_in_seconds():
    model, train, text = plan_in_seconds("hlat-7b")
    assert model.num_params() == llama_params(32, 4096, 32, 32, 11008, 32000) == 6_738_415_616
    assert "world 2048 = dp 256 x pp 1 x tp 8" in text

    # each rank: 1/8 of every matrix, all 65 norm vectors (2 per layer + final)
    matrices = 32 * (4 * 4096**2 + 3 * 4096 * 11008) + 2 * 32000 * 4096
    per_rank = matrices // 8 + 65 * 4096
    mem = plan.memory_per_rank(model, train, 8, 1, 256, 0)
    assert mem["params"] == per_rank == 842_534_912
    assert mem["weights"] == 2 * per_rank and mem["grads"] == 0   # bf16; gradients go straight to fp32
    # bf16-sr with bf16 moments (HLAT's pure bf16): two 2-byte moments, the master weights are the
    # parameters themselves; not sharded (no ZeRO-1); the whole rank fits a 16 GiB NeuronCore
    assert mem["optimizer"] == mem["optimizer_replicated"] == 4 * per_rank
    assert mem["peak"] <= 14.0 * 2**30

    comm = plan.comm_bytes_per_step(model, train, Mesh(8, 1, 256, 0))
    assert comm["dp.all_reduce"] == 4 * per_rank + 4                         # fp32 grads + the loss
    # sequence parallel: per layer 2 all-gathers forward + 2 backward (the
    # reduce-scatters' conjugates) of the (4, 4096, 4096) bf16 residual stream,
    # plus the embedding's and the head's; --sp-regather gathers the inputs of
    # the layer's 2 matmul groups and the head's once more in backward
    act = 4 * 4096 * 4096 * 2
    assert comm["tp.all_gather"] == (32 * 2 * 2 + 2 + 32 * 2 + 1) * act + 8 * 4 * 4096 * 4

    # 46 GFLOP per token: 6 x matmul params + 12 L d T
    n_matmul = matrices - 32000 * 4096
    assert metrics.flops_per_token(model, 4096) == 6 * n_matmul + 12 * 32 * 4096 * 4096


def test_hlat_70b_tp32_pp8_zero1_on_2048_ranks_plans_in_seconds():
    model, train, text = plan_in_seconds("hlat-70b")
    assert model.num_params() == llama_params(80, 8192, 64, 8, 28672, 32000) == 68_976_648_192
    assert "world 2048 = dp 8 x pp 8 x tp 32" in text
    assert "replica of one kv head" in text   # tp 32 > 8 kv heads: HLAT replicated them

    # stage 0: layers 0-9 and the embedding; each tp rank 1/32 of wq, wo and
    # the MLP, one whole kv head (128 x 8192) in wk and wv, all 20 norms
    layer = (2 * 8192**2 + 3 * 8192 * 28672) // 32 + 2 * 8192 * 128
    sharded = 10 * layer + 32000 * 8192 // 32
    mem = plan.memory_per_rank(model, train, 32, 8, 8, 0)
    assert mem["params"] == sharded + 20 * 8192
    # ZeRO-1 with fp32 master weights beside the bf16 parameters: 12 B per parameter, 1/8 each
    assert mem["optimizer"] == mem["optimizer_zero1"] == 12 * (sharded // 8 + 20 * 8192 // 8)
    assert mem["optimizer_replicated"] == 12 * mem["params"]
    # 1F1B: stage s holds min(pp - s, m) micro-batches
    assert [plan.microbatches_in_flight("1f1b", 8, 128, s) for s in range(8)] == [8, 7, 6, 5, 4, 3, 2, 1]


@pytest.mark.parametrize("argv, world", [(["--preset", "hlat-7b"], 2048), (["--preset", "hlat-70b"], 2048),
                                         (["--preset", "hlat-7b", "--batch-size", "16", "--microbatches", "4"], 32)])
def test_hlats_layouts_leave_two_gib_of_a_neuroncore(argv, world):
    """HLAT's own layouts (the 7B without ZeRO-1, as HLAT ran it; the one-instance layout of
    docs/trn1.md section 4) peak at most 14 of a NeuronCore's 16 GiB: the runtime and the
    compiler's scratch need the rest."""
    model, train = recipe.parse_args(argv)
    assert train.zero == (1 if argv[1] == "hlat-70b" else 0)
    text = plan.report(model, train, world)
    peak = re.search(r"largest stage \d+: ([\d.]+) GiB of 16.00 GiB on one NeuronCore-v2: fits", text)
    assert peak and float(peak.group(1)) <= 14.0, text[-3000:]


def test_plan_flag_prints_and_returns_before_any_data_or_worker(monkeypatch, capsys):
    import train
    from nanohlat.run import data, launch

    def refuse(*a, **k):
        raise AssertionError("--plan must not prepare data or start workers")
    monkeypatch.setattr(data, "prepare_data", refuse)
    monkeypatch.setattr(launch, "spawn", refuse)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert train.main(["--plan", "--preset", "hlat-7b", "--nproc", "2048"]) == 0
    out = capsys.readouterr().out
    for section in ("mesh", "memory per rank", "activations per rank", "compute:", "communication per step"):
        assert section in out, section
