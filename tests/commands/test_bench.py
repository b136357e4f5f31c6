"""The benchmark's printed figures: the ratio lines the README quotes, and the
round-by-round spread printed beside them (nanohlat/bench/bench.py)."""

import importlib.util
import re

import pytest
import torch

from nanohlat.bench import bench, mixtral, ratios

TINY = ["--n-layers", "1", "--d-model", "64", "--n-heads", "2", "--n-kv-heads", "2", "--ffn-dim", "128",
        "--vocab-size", "256", "--seq-len", "32", "--batch-size", "2", "--warmup", "1", "--threads", "1"]


def test_spread_pairs_the_steps_of_one_round():
    # the machine slows down every other round; each round's two steps slow
    # together, so every paired ratio is the same 1/1.1
    times = {"hf-llama": [1.0, 2.0, 1.0, 2.0, 1.0], "nanohlat": [1.1, 2.2, 1.1, 2.2, 1.1]}
    assert ratios.paired_ratios(times, "nanohlat") == pytest.approx([1 / 1.1] * 5)
    assert "nanohlat         0.909x   0.909x - 0.909x" in ratios.spread(times, ["nanohlat"])
    # a step that is faster in some rounds and slower in others: the middle half spans 1.00x
    times = {"hf-llama": [1.0] * 8, "nanohlat": [0.8, 0.9, 0.95, 1.0, 1.0, 1.05, 1.1, 1.25]}
    text = ratios.spread(times, ["nanohlat"])
    q1, q3 = (float(x) for x in re.search(r"(\d\.\d+)x - (\d\.\d+)x", text).groups())
    assert q1 < 1.0 < q3
    # too few rounds for quartiles: the median alone, and why
    assert "needs --steps 4" in ratios.spread({"hf-llama": [1.0, 1.0], "nanohlat": [1.0, 2.0]}, ["nanohlat"])


@pytest.mark.slow
def test_bench_ends_with_the_ratio_lines(capsys):
    pytest.importorskip("transformers")
    rc = bench.main(TINY + ["--steps", "4"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert "hf-llama: torch.optim.AdamW(fused=True), torch's fastest for cpu fp32, and clip_grad_norm_" in out
    assert re.fullmatch(r"nanohlat / hf-llama tokens/s: \d+\.\d{3}x \(median of 4 rounds, middle half "
                        r"\d+\.\d{3}x - \d+\.\d{3}x\)", out[-3])
    # at one thread, the same ratio of CPU times: what the load's preemption leaves out
    assert out[-2].startswith("CPU time per step (one thread")
    assert re.fullmatch(r"  hf-llama / nanohlat CPU time: \d+\.\d{3}x \(median of 4 rounds, middle half "
                        r"\d+\.\d{3}x - \d+\.\d{3}x\)", out[-1])
    load = next(i for i, line in enumerate(out) if line.startswith("load average (1 min): "))
    assert re.fullmatch(r"load average \(1 min\): \d+\.\d\d before, \d+\.\d\d after the timing; \d+ cores, "
                        r"this bench's 1 thread\(s\)", out[load])
    assert re.fullmatch(r"  nanohlat +\d+\.\d{3}x +\d+\.\d{3}x - \d+\.\d{3}x", out[load - 2])
    row = next(line for line in out if line.startswith("hf-llama "))      # both phases of the reference
    assert re.search(r"\d+\.\d ms +\d+\.\d ms$", row), row


def test_the_references_train_with_torchs_fastest_adamw(monkeypatch):
    """The Hugging Face references' AdamW is the fused one where torch has it for the device and dtype
    (the CPU's, fp32 and bf16), else foreach; never torch's default per-tensor loop. Same hyperparameters
    as nanohlat's, weight decay on matrices only."""
    model_cfg, tcfg = bench.parse(["--preset", "tiny", "--no-hf"])[:2]
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    for dtype in (torch.float32, torch.bfloat16):
        opt = mixtral.hf_adamw(model.to(dtype), tcfg)
        assert mixtral.adamw_kind(opt) == "fused" and opt.defaults["fused"] and not opt.defaults["foreach"]
        assert [(g["lr"], g["betas"], g["eps"], g["weight_decay"], len(g["params"])) for g in opt.param_groups] == [
            (tcfg.lr, (tcfg.beta1, tcfg.beta2), tcfg.adam_eps, tcfg.weight_decay, 1),
            (tcfg.lr, (tcfg.beta1, tcfg.beta2), tcfg.adam_eps, 0.0, 3)]
    # where torch has no fused kernel for the device (it raises when the step finds out), foreach
    real = torch.optim.AdamW

    def no_fused(params, *args, fused=None, **kwargs):
        if fused:
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported devices")
        return real(params, *args, fused=fused, **kwargs)
    monkeypatch.setattr(torch.optim, "AdamW", no_fused)
    assert mixtral.fastest_adamw(torch.device("cpu"), torch.float32) == "foreach"
    assert mixtral.adamw_kind(mixtral.hf_adamw(model, tcfg)) == "foreach"


def test_a_loaded_machine_is_said_to_give_no_result():
    """The load line: above the core count (before or after the timing), the ratios are not a result."""
    quiet = ratios.load_line((0.4, 1.9), 2, 2)
    assert quiet == "load average (1 min): 0.40 before, 1.90 after the timing; 2 cores, this bench's 2 thread(s)"
    busy = ratios.load_line((2.6, 1.9), 2, 1)
    assert busy.splitlines()[1].startswith("not a result: the load was above the 2 cores")
    assert ratios.loaded((0.1, 2.01), 2) and not ratios.loaded((2.0, 2.0), 2)
    times = {"hf-llama": [1.0, 1.0, 1.0, 1.0, 1.0], "nanohlat": [0.5, 1.0, 0.8, 1.25, 1.0]}
    assert ratios.ratio_line(times, "nanohlat", "hf-llama") == (
        "nanohlat / hf-llama tokens/s: 1.000x (median of 5 rounds, middle half 0.900x - 1.625x)")


def test_each_engine_runs_next_to_its_own_reference():
    """The compiled engine beside the compiled reference, the eager one beside the eager reference, in
    every round's order (the order reverses every round, so each pair stays neighbours)."""
    ours = {"nanohlat": 1, "nanohlat-compile": 2, "nanohlat-xla": 3}
    refs = {"hf-llama": 4, "hf-llama-compile": 5}
    pairs = {"nanohlat": "hf-llama", "nanohlat-compile": "hf-llama-compile", "nanohlat-xla": "hf-llama"}
    assert list(bench.ordered(ours, refs, pairs)) == ["nanohlat", "hf-llama", "hf-llama-compile",
                                                      "nanohlat-compile", "nanohlat-xla"]
    assert list(bench.ordered({"nanohlat-compile": 2}, {"hf-llama-compile": 5}, pairs)) == [
        "hf-llama-compile", "nanohlat-compile"]


def test_xla_engine_without_torch_xla_says_so(capsys):
    if importlib.util.find_spec("torch_xla") is not None:
        pytest.skip("torch_xla is installed here: tests/core/test_xla.py runs the xla engine")
    assert bench.main(TINY + ["--steps", "2", "--no-hf", "--engines", "xla"]) == 2
    out, err = capsys.readouterr()
    assert "torch_xla is not installed here" in out
    assert err.strip() == "error: none of --engines can run here"


@pytest.mark.parametrize("args, message", [
    (["--warmup", "-5"], "--warmup must be >= 0, got -5"),
    (["--generate", "--seq-len", "15"], "give --seq-len >= 16"),
    (["--engines", "eager,tpu"], "--engines tpu: choose from eager, compile, xla"),
    (["--cp", "2"], "--cp 2 would not be run; leave --nproc, --dp, --tp, --pp, --cp, --ep and --microbatches at 1"),
    # (issue 50) timed one process at ep 1 and exited 0
    (["--nproc", "2", "--dp", "2"], "the bench times one process, one micro-batch: --nproc 2, --dp 2 would not be run"),
    (["--preset", "moe", "--ep", "2"], "--ep 2 would not be run"),
    (["--nproc", "2"], "--nproc 2 would not be run"),
    (["--moe-experts", "4", "--moe-capacity-factor", "1e30"], "--moe-capacity-factor 1e+30 is above --moe-experts / "
                                                                "--moe-top-k = 2"),
])
def test_bench_flags_out_of_range_are_one_line(args, message, capsys):
    assert bench.main(["--preset", "tiny", "--no-hf"] + args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message in err, err


@pytest.mark.slow
def test_the_bench_times_a_mixture_of_experts_beside_mixtral_from_the_same_weights(capsys):
    """--preset moe was an AssertionError (a dense Llama built beside it): now Hugging Face's
    MixtralForCausalLM of the same shape, loaded with nanohlat's initial weights through the export
    mapping, is timed beside it, and the two first-step losses must agree (fp32: <= 1e-5; measured
    4.8e-7). A mixture Mixtral cannot express (shared experts) is timed alone, and says why."""
    pytest.importorskip("transformers")
    assert bench.main(["--preset", "moe", "--n-layers", "1", "--steps", "2", "--warmup", "0", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "hf-mixtral: Hugging Face's MixtralForCausalLM" in out and re.search(r"^hf-mixtral +\d", out, re.M), out
    diff = float(re.search(r"first-step loss from the same initial weights: nanohlat \d+\.\d+, "
                           r"hf-mixtral \d+\.\d+, \|diff\| (\S+) <= 1e-05", out).group(1))
    assert diff <= 1e-5
    assert "hf-mixtral: torch.optim.AdamW(fused=True), torch's fastest for cpu fp32" in out
    assert re.search(r"^nanohlat / hf-mixtral tokens/s: \d+\.\d{3}x \(median of 2 rounds, middle half: needs "
                     r"--steps 4 or more\)$", out, re.M), out
    assert bench.main(["--preset", "moe", "--n-layers", "1", "--moe-shared-experts", "1", "--steps", "1",
                       "--warmup", "0", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "(no Hugging Face model of this shape, timing nanohlat alone: this mixture of experts" in out
    assert re.search(r"^nanohlat +\d", out, re.M) and "hf-mixtral" not in out, out


def test_a_mixtral_whose_first_loss_differs_voids_the_comparison():
    from nanohlat.bench import mixtral
    assert mixtral.first_losses(2.0, 2.0 + 4e-6, "fp32")[1]
    line, same = mixtral.first_losses(2.0, 2.0 + 2e-5, "fp32")
    assert not same and "not the same model, the comparison is void" in line


def test_cp_attention_figures_are_per_round_ratios_of_the_slowest_rank():
    """nanohlat/bench/cp_attention.py: each round's slowest cp rank over one process's in the same round;
    the median of those ratios and their range (made-up seconds)."""
    from nanohlat.bench import cp_attention
    ranks = [[(1.0, 2.0), (3.0, 2.0), (1.0, 1.0)], [(2.0, 1.0), (1.0, 4.0), (1.0, 3.0)]]   # 2 ranks x 3 rounds
    assert cp_attention.slowest(ranks) == [(2.0, 2.0), (3.0, 4.0), (1.0, 3.0)]
    one = [(4.0, 4.0), (6.0, 8.0), (4.0, 4.0)]
    cpu, wall, rc, rw = cp_attention.figures(cp_attention.slowest(ranks), one)
    assert (cpu, wall, rc, rw) == (2.0, 3.0, [0.5, 0.5, 0.25], [0.5, 0.5, 0.75])
    assert cp_attention.ratio_text(rc) == "0.50 (0.25-0.50)"
