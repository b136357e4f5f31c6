"""Specifications for nanohlat/device.py, nanohlat/xla.py, nanohlat/tools/metrics.py and nanohlat/run/trainlog.py."""

import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from nanohlat.config import UserError
from nanohlat.recipe import PRESETS, ModelConfig
from dist_utils import free_port
from nanohlat import xla
from nanohlat.device import get_device
from nanohlat.run import trainlog
from nanohlat.run.trainlog import MetricsWriter
from nanohlat.tools.metrics import PEAK_FLOPS, Throughput, flops_per_token, mfu, peak_flops, peak_memory

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAS_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (so sys.modules starts empty)."""
    full_env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **env}
    full_env = {k: v for k, v in full_env.items() if v is not None}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=120)


# -- device ------------------------------------------------------------------

def test_cpu_device_never_imports_torch_xla():
    result = run_python("""
        import sys
        from nanohlat.device import get_device
        d = get_device("cpu")
        assert (d.kind, d.backend, d.name, str(d.torch_device)) == ("cpu", "gloo", "cpu", "cpu"), d
        d.sync()
        print("torch_xla" in sys.modules)
    """, PJRT_DEVICE=None)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_unknown_device_kind_is_a_user_error():
    with pytest.raises(UserError, match="tpu"):
        get_device("tpu")


@pytest.mark.skipif(HAS_TORCH_XLA, reason="torch_xla is installed here")
def test_xla_without_torch_xla_says_what_to_install():
    with pytest.raises(UserError, match="pip install torch==2.9.0 torch_xla==2.9.0"):
        get_device("xla")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_a_user_error():
    with pytest.raises(UserError, match="--device cpu"):
        get_device("cuda")


def test_cpu_device_runs_closures_now_and_copies_to_host():
    d = get_device("cpu")
    seen = []
    d.add_step_closure(lambda a, b: seen.append(a + b), 1, 2)
    assert seen == [3]  # eager backends have the values already

    w = torch.ones(3)
    host = xla.to_host({"w": w, "rest": [w, (w, 7)], "step": 5})
    w.add_(1)  # training goes on: the snapshot must not change
    assert host["w"].tolist() == [1, 1, 1] and host["rest"][1][0].tolist() == [1, 1, 1]
    assert host["step"] == 5 and isinstance(host["rest"][1], tuple)
    assert xla.compile_count() is None    # torch_xla never loaded here


def test_cpu_checkpoint_gives_the_same_gradients():
    d = get_device("cpu")
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)

    def grads(use_checkpoint):
        lin.zero_grad()
        out = d.checkpoint(lin, x) if use_checkpoint else lin(x)
        torch.tanh(out).sum().backward()
        return lin.weight.grad.clone()

    assert torch.equal(grads(True), grads(False))


def test_extract_graphs_only_follows_the_neuron_variable(monkeypatch):
    monkeypatch.delenv("NEURON_EXTRACT_GRAPHS_ONLY", raising=False)
    assert not xla.extract_graphs_only()
    monkeypatch.setenv("NEURON_EXTRACT_GRAPHS_ONLY", "1")
    assert xla.extract_graphs_only()


@pytest.mark.xla
@pytest.mark.skipif(not HAS_TORCH_XLA, reason="needs torch_xla (run .ci/xla-lane)")
def test_xla_device_on_cpu_syncs_logs_and_compiles_once():
    # One process under PJRT_DEVICE=CPU: placement, step closures, checkpointing
    # and graph counts work; collectives across processes cannot be tested here.
    result = run_python("""
        import sys, torch, torch.distributed
        from nanohlat import xla
        from nanohlat.device import get_device
        assert "torch_xla" not in sys.modules
        d = get_device("xla")
        assert (d.kind, d.backend, d.name) == ("xla", "xla", "cpu"), d
        d.init_process_group(0, 1)
        d.new_group([0], [[0]])
        d.manual_seed(0)
        lin = torch.nn.Linear(8, 8).to(d.torch_device)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        x = torch.randn(4, 8).to(d.torch_device).requires_grad_(True)
        losses, counts = [], []
        for step in range(4):
            loss = d.checkpoint(lambda t: torch.tanh(lin(t)), x).pow(2).mean()
            loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
            d.add_step_closure(lambda l: losses.append(l.item()), loss.detach())
            assert len(losses) == step  # queued, not run: no host sync inside the step
            d.sync()
            counts.append(xla.compile_count())
        assert len(losses) == 4 and losses[-1] < losses[0], losses
        assert counts[0] >= 1 and counts[1:] == [counts[-1]] * 3, counts  # nothing compiles after the first steps
        host = xla.to_host({"w": lin.weight})
        assert host["w"].device.type == "cpu"
        torch.distributed.destroy_process_group()
        try:  # torch_xla on CPU forms a world of 1 whatever was asked: refused
            d.init_process_group(0, 2)
            raise AssertionError("a world of 1 was accepted as 2")
        except RuntimeError as e:
            assert "expected rank 0 of 2" in str(e), e
        print("ok")
    """, PJRT_DEVICE="CPU", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


# -- metrics -----------------------------------------------------------------

def test_peak_memory_on_the_cpu_covers_what_the_process_touched():
    x = torch.ones(64 * 2**20 // 4)          # 64 MiB, written: resident
    assert peak_memory(get_device("cpu")) >= x.numel() * 4



def test_flops_per_token_hlat_7b_matches_hand_count():
    cfg = ModelConfig(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=32, ffn_dim=11008,
                      vocab_size=32000, max_seq_len=4096)
    # per layer: q,k,v,o 4 * 4096^2 = 67,108,864; SwiGLU 3 * 4096 * 11008 = 135,266,304
    # 32 layers = 6,476,005,376; head 32000 * 4096 = 131,072,000 -> N = 6,607,077,376
    # 6N = 39,642,464,256; attention 12 * 32 * 4096 * 4096 = 6,442,450,944
    hand = 39_642_464_256 + 6_442_450_944  # = 46,084,915,200 FLOPs per token (~46 GFLOP)
    assert abs(flops_per_token(cfg, 4096) - hand) / hand < 0.01
    # and the preset really is that shape
    preset = PRESETS["hlat-7b"][0]
    assert flops_per_token(preset, 4096) == flops_per_token(cfg, 4096)


def test_flops_per_token_counts_grouped_query_attention_smaller():
    mha = ModelConfig(n_layers=2, d_model=64, n_heads=8, n_kv_heads=8, ffn_dim=176, vocab_size=512)
    gqa = ModelConfig(n_layers=2, d_model=64, n_heads=8, n_kv_heads=2, ffn_dim=176, vocab_size=512)
    # k and v shrink from 64x64 to 64x16 each: 2 layers * 2 * 64 * 48 fewer weights, 6 FLOPs each
    assert flops_per_token(mha, 32) - flops_per_token(gqa, 32) == 6 * 2 * 2 * 64 * 48


def test_peak_flops_and_mfu_arithmetic():
    assert peak_flops("NeuronCore-v2", "bf16-sr") == 95e12  # half of a 190 TFLOP/s chip
    assert peak_flops("NeuronCore-v2", "fp32") == 23.75e12
    assert peak_flops("A100", "bf16-mixed") == 312e12
    assert peak_flops("H200", "bf16") == PEAK_FLOPS["H100"]["bf16"]
    assert peak_flops("cpu", "fp32", threads=2) == 2 * PEAK_FLOPS["cpu"]["fp32"]
    assert peak_flops("unknown", "fp32") is None
    with pytest.raises(UserError, match="fp16"):
        peak_flops("A100", "fp16")

    # 1000 tokens/s * 6e9 FLOPs/token on 2 devices of 5e12 = 6e12 / 1e13
    assert mfu(1000.0, 6e9, 2 * 5e12) == pytest.approx(0.6, rel=1e-12)
    assert mfu(1000.0, 6e9, None) is None


def test_mfu_above_one_is_not_reported_but_warned_once(monkeypatch, capsys):
    from nanohlat.tools import metrics
    monkeypatch.setattr(metrics, "_mfu_warned", False)
    assert mfu(1000.0, 6e9, 5e12) is None                   # 120%: the peak is wrong, not the model
    assert mfu(1000.0, 6e9, 4e12) is None
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "120%" in err and "underestimated" in err
    assert mfu(1000.0, 6e9, 6e12) == pytest.approx(1.0)      # exactly the peak is still possible


def test_cpu_peak_is_one_definition_measured_once_per_process(monkeypatch):
    """train.py and bench.py both divide by metrics.device_peak; on the CPU that is
    the best of CPU_PEAK_MATMULS (2048^3 among them), measured once per thread count."""
    from nanohlat.tools import metrics
    assert max(n for n, _ in metrics.CPU_PEAK_MATMULS) >= 2048
    calls = []
    monkeypatch.setattr(metrics, "CPU_PEAK_MATMULS", ((32, 2), (64, 2)))
    monkeypatch.setattr(metrics, "_cpu_peaks", {})
    real = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, **k: calls.append(a) or real(*a, **k))
    cpu = get_device("cpu")
    first = metrics.device_peak(cpu, "fp32")
    assert first > 0 and metrics.device_peak(cpu, "bf16") == first == metrics.measure_cpu_peak()
    assert calls == [(32, 32), (32, 32), (64, 64), (64, 64)]          # measured once, both sizes
    assert "64" in metrics.describe_peak(cpu, "fp32", 2) and "2 x" in metrics.describe_peak(cpu, "fp32", 2)
    for path in ("train.py", "nanohlat/bench/bench.py"):   # neither has a peak of its own
        with open(os.path.join(REPO, path)) as f:
            source = f.read()
        assert "measure_cpu_peak(" not in source and "peak_flops(" not in source, path


def test_metrics_writer_round_trips_full_precision_and_appends(tmp_path):
    values = [0.1 + 0.2, 1 / 3, math.pi, 1e-300, 2.0 ** -1074, 123456789.12345678]
    with MetricsWriter(str(tmp_path / "metrics.jsonl")) as w:
        w.write({"step": 1, "values": values})
    # a resumed run opens the same file (here via its out_dir) and continues it
    w = MetricsWriter(str(tmp_path))
    w.write({"step": 2, "loss": 1 / 7})
    w.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert json.loads(lines[0])["values"] == values  # bit-exact, not approximately
    assert json.loads(lines[1])["loss"] == 1 / 7


def test_throughput_ignores_the_first_step_and_slides():
    t = Throughput(window=2)
    assert t.update(1000, now=100.0) is None  # compile step: starts the clock only (unknown, not 0)
    assert t.update(500, now=101.0) == 500.0
    assert t.update(500, now=102.0) == 500.0
    assert t.update(1500, now=103.0) == 1000.0  # window: the last two steps, 2000 tokens in 2 s


def test_resampling_the_cpu_peak_keeps_the_best(monkeypatch):
    """bench.py samples the peak again after every round: a slow first sample
    (a busy moment of a shared machine) is replaced by a better later one, and
    a worse later one changes nothing."""
    from nanohlat.tools import metrics
    rates = iter([1e9, 3e9, 2e9])
    monkeypatch.setattr(metrics, "_best_matmul_rate", lambda: next(rates))
    monkeypatch.setattr(metrics, "_cpu_peaks", {})
    assert metrics.measure_cpu_peak() == 1e9
    assert metrics.resample_cpu_peak() == 3e9 == metrics.measure_cpu_peak()
    assert metrics.resample_cpu_peak() == 3e9


def test_a_stale_cpu_peak_is_measured_again_when_beaten_and_unknown_mfu_prints_as_unknown(monkeypatch):
    """A peak sampled while the machine was busy: the run's rate beats it, so
    the peak is measured again (once a minute at most) and MFU is read against
    the new one; the CPU generator is left as it was (training numerics)."""
    import types
    from nanohlat.tools import metrics
    rates = iter([4e9, 4e9])
    monkeypatch.setattr(metrics, "_best_matmul_rate", lambda: (torch.randn(3), next(rates))[1])
    monkeypatch.setattr(metrics, "_cpu_peaks", {torch.get_num_threads(): 1e9})   # the stale, busy sample
    log = types.SimpleNamespace(peak_total=1e9, dev=types.SimpleNamespace(kind="cpu"), flops_tok=1e6,
                                world=1, resampled_at=None)
    state = torch.get_rng_state()
    assert trainlog.TrainLog._mfu(log, 2000.0) == pytest.approx(0.5)     # 2 GFLOP/s over the new 4
    assert torch.equal(torch.get_rng_state(), state) and log.peak_total == 4e9
    again = log.resampled_at
    assert trainlog.TrainLog._mfu(log, 3000.0) == pytest.approx(0.75) and log.resampled_at == again   # not beaten


def test_the_progress_bar_prints_unknown_mfu_as_unknown_not_zero(monkeypatch, cache_dir, tmp_path, capsys):
    import train
    from nanohlat import recipe
    from nanohlat.run import preflight
    from nanohlat.tools import metrics
    monkeypatch.setattr(metrics, "_best_matmul_rate", lambda: 1.0)       # a peak every rate beats
    monkeypatch.setattr(metrics, "_cpu_peaks", {})
    monkeypatch.setattr(metrics, "_mfu_warned", False)
    argv = ["--preset", "tiny", "--steps", "2", "--eval-every", "0", "--threads", "1", "--cache-dir", cache_dir,
            "--out-dir", str(tmp_path / "run")]
    train.train(*preflight.inputs(*recipe.parse_args(argv)))
    err = capsys.readouterr().err
    assert "mfu=?" in err and "mfu=0.0%" not in err, err
    assert err.count("MFU is not reported") == 1
    # the record says unknown too: null (None), never 0.0 -- the first step is not timed, and an
    # MFU above 100% is not reported
    first, second = (json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
    assert first["tokens_per_s"] is None and first["mfu"] is None, first
    assert second["tokens_per_s"] > 0 and second["mfu"] is None, second


def test_a_known_mfu_is_recorded_from_the_second_step(monkeypatch, cache_dir, tmp_path, capsys):
    import train
    from nanohlat import recipe
    from nanohlat.run import preflight
    from nanohlat.tools import metrics
    monkeypatch.setattr(metrics, "_best_matmul_rate", lambda: 1e15)      # a peak no rate beats
    monkeypatch.setattr(metrics, "_cpu_peaks", {})
    argv = ["--preset", "tiny", "--steps", "2", "--eval-every", "0", "--threads", "1", "--no-progress",
            "--cache-dir", cache_dir, "--out-dir", str(tmp_path / "run")]
    train.train(*preflight.inputs(*recipe.parse_args(argv)))
    first, second = (json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
    assert first["tokens_per_s"] is None and first["mfu"] is None, first
    assert second["tokens_per_s"] > 0 and 0 < second["mfu"] < 1, second
