"""The XLA path, single rank, on torch_xla's CPU backend (PJRT_DEVICE=CPU).

Run by .ci/xla-lane (torch 2.9 + torch_xla 2.9, the versions torch-neuronx 2.9
pins on trn1); skipped where torch_xla is not installed. What this checks is
what one process on the CPU can check of the trn1 path (docs/design.md section 3): device
placement, sync points, step closures, graph counts, checkpoints across
devices, and sampling. Collectives across processes need a real xla backend
(torch_xla on the CPU has none), so every test here is world=1.

The training runs happen in two child processes (`python tests/core/test_xla.py
cpu|xla CACHE OUT`, the bottom of this file): torch_xla's compile counters and
graph cache are per process, and a child starts them from zero. Each prints
what it measured as JSON; the tests below read it.

Tolerance, XLA vs eager CPU: both run the same fp32 math, but XLA compiles the
step into one fused graph (other kernels, other orders of additions) so the
two agree to fp32 round-off, ~1e-7 relative per operation, grown through 4
layers and 6 optimizer steps. Measured on tiny (loss ~6.2): losses within
5e-7; we allow LOSS_TOL = 1e-4. The grad norm (~1.5) is one long reduction
over all 250k gradient elements, where summation order shows most: measured
within 5e-5 (3e-5 relative); we allow NORM_RTOL = 5e-4 relative. A real bug
(a dropped gradient, a wrong lr, a stale weight) moves the loss of step 3 by
> 1e-2 and the grad norm by more than 1e-2 relative. Final weights: within
1e-4 (measured 1.5e-5): Adam's update g / (sqrt(v) + eps) turns round-off in
a near-zero gradient into a visible fraction of lr for a few elements (see
test_layouts_equal_one_process.py).

Graph counts. The first two steps compile (step 1 also creates the optimizer
state; from step 2 on every input is device data). After that a training
step, an evaluation and a checkpoint save each reuse their graph: from the
start of step 3 (by when one of each has run) to the end of the run, the
number of compiled graphs must not change.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

HAS_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None
pytestmark = [pytest.mark.xla, pytest.mark.skipif(not HAS_TORCH_XLA, reason="needs torch_xla (run .ci/xla-lane)")]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOSS_TOL, NORM_RTOL = 1e-4, 5e-4
STEPS, WARMUP = 6, 2        # WARMUP: steps that may compile
BASE = ["--preset", "tiny", "--steps", str(STEPS), "--batch-size", "8", "--seq-len", "32", "--warmup-steps", "2",
        "--eval-every", "2", "--eval-batches", "1", "--save-every", "2", "--no-progress"]
# name -> extra flags; each is trained on the xla device (and "plain" also eagerly on the CPU)
RUNS = {
    "plain": [],
    "accumulation": ["--microbatches", "2", "--log-every", "2"],
    "selective": ["--activation-checkpointing", "selective"],
    "full": ["--activation-checkpointing", "full"],
    "bf16": ["--precision", "bf16"],
    "bf16_sr": ["--precision", "bf16-sr"],
    "bf16_mixed": ["--precision", "bf16-mixed"],     # a separate fp32 master beside the parameters
}


def child_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NEURON_EXTRACT_GRAPHS_ONLY"}
    env.update(PJRT_DEVICE="CPU", PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""), **extra)
    return env


@pytest.fixture(scope="module")
def measured(cache_dir, tmp_path_factory):
    """Everything the two child processes trained and measured (see `child` below)."""
    out = tmp_path_factory.mktemp("xla")
    result = {"out": str(out)}
    for mode in ("cpu", "xla"):
        proc = subprocess.run([sys.executable, __file__, mode, cache_dir, str(out)], cwd=REPO, env=child_env(),
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
        result |= json.loads(proc.stdout.strip().splitlines()[-1], object_hook=int_keys)
    return result


def int_keys(d: dict) -> dict:
    """JSON turns the step numbers of {step: value} into strings; turn them back."""
    return {int(k) if k.isdigit() else k: v for k, v in d.items()}


def close(a: dict, b: dict, tol: float) -> list:
    """Steps where two {step: value} maps differ by more than tol (and missing steps)."""
    return [(s, a.get(s), b.get(s)) for s in sorted(set(a) | set(b))
            if a.get(s) is None or b.get(s) is None or abs(a[s] - b[s]) > tol]


# -- training on XLA gives the eager CPU's numbers ------------------------------

def test_xla_training_gives_the_eager_cpu_losses(measured):
    cpu, xla = measured["cpu"], measured["runs"]["plain"]
    assert sorted(cpu["loss"]) == list(range(1, STEPS + 1))
    assert not close(xla["loss"], cpu["loss"], LOSS_TOL)
    assert not close(xla["grad_norm"], cpu["grad_norm"], NORM_RTOL * max(cpu["grad_norm"].values()))
    assert not close(xla["val_loss"], cpu["val_loss"], LOSS_TOL)
    assert xla["loss"][STEPS] < xla["loss"][1] - 0.1     # and it learns


@pytest.mark.parametrize("name", ["accumulation", "selective", "full"])
def test_accumulation_and_checkpointing_on_xla_give_the_same_losses(measured, name):
    # 2 micro-batches of 4 = one batch of 8; recomputing activations changes nothing
    cpu, xla = measured["cpu"], measured["runs"][name]
    assert not close(xla["loss"], {s: cpu["loss"][s] for s in xla["loss"]}, LOSS_TOL)
    if name == "accumulation":
        assert sorted(xla["loss"]) == [2, 4, 6]     # --log-every 2


def test_the_cpu_run_never_imported_torch_xla(measured):
    assert measured["torch_xla_imported_by_cpu_run"] is False


# -- no graph compiles after the warm-up steps ------------------------------------

@pytest.mark.parametrize("name", list(RUNS))
def test_nothing_compiles_after_the_warmup_steps(measured, name):
    run = measured["runs"][name]
    counts = run["compiles_at_step_start"] + [run["compiles_at_end"]]   # steps 1..STEPS, then the end
    assert counts[0] < counts[WARMUP], counts       # the warm-up did compile
    after = counts[WARMUP:]                         # start of step 3 .. end (evals, saves, final save)
    assert after == [after[0]] * len(after), f"graphs compiled after the warm-up: {counts}"


def test_bf16_sr_rounds_stochastically_on_xla_cpu(measured):
    # No Neuron runtime here, so bf16-sr must not silently become round-to-nearest (bf16):
    # the software rounding (its noise: hashed integer ops, precision.py) runs in the XLA graph
    runs = measured["runs"]
    assert runs["bf16_sr"]["loss"] != runs["bf16"]["loss"]
    assert not close(runs["bf16_sr"]["loss"], measured["cpu"]["loss"], 0.05)   # bf16-sized differences only


# -- checkpoints cross devices ------------------------------------------------------

def test_checkpoint_written_on_xla_continues_on_cpu(measured):
    cpu, cont = measured["cpu"]["loss"], measured["xla_then_cpu"]["loss"]
    assert sorted(cont) == list(range(1, STEPS + 1))
    assert not close(cont, cpu, LOSS_TOL)


def test_checkpoint_written_on_cpu_continues_on_xla(measured):
    cpu, cont = measured["cpu"]["loss"], measured["cpu_then_xla"]["loss"]
    assert sorted(cont) == list(range(1, STEPS + 1))
    assert not close(cont, cpu, LOSS_TOL)


def test_xla_checkpoint_weights_load_on_cpu(measured):
    # the final weights of the XLA run, loaded for inference on the CPU, are the eager run's
    assert measured["max_weight_diff_xla_vs_cpu"] < 1e-4


def test_neuron_graph_extraction_skips_value_checks_and_writes_no_checkpoint(measured):
    # neuron_parallel_compile's trial run (NEURON_EXTRACT_GRAPHS_ONLY=1) returns zeros, not values:
    # no NaN stop, and no checkpoint a later --resume auto would start from
    run = measured["extract_graphs_only"]
    assert run["step"] == STEPS
    assert run["checkpoints"] == []


def test_to_host_copies_a_nested_snapshot_from_xla(measured):
    got = measured["to_host"]
    assert got["types"] == ["list", "tuple"] and got["devices"] == ["cpu"] and got["others"] == [7, None]
    assert got["values"] == [[1, 2, 3, 4, 5, 6], [2, 3], [3, 4, 5]]


# -- sampling ------------------------------------------------------------------------

def test_sample_py_runs_on_xla_and_matches_cpu(measured):
    run_dir = os.path.join(measured["out"], "plain")
    cmd = [sys.executable, "sample.py", "--out-dir", run_dir, "--prompt", "import os", "--max-new-tokens", "4",
           "--temperature", "0"]
    texts = {}
    for device in ("xla", "cpu"):
        proc = subprocess.run(cmd + ["--device", device], cwd=REPO, env=child_env(), capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        texts[device] = proc.stdout
    assert texts["xla"].startswith("import os") and len(texts["xla"]) > len("import os\n")
    assert texts["xla"] == texts["cpu"]     # greedy: the same tokens


# ---------------------------------------------------------------------------
# The child processes: train everything once, print one line of JSON.
# Mode "cpu" runs first, in a process that never asks for the xla device (and
# must not import torch_xla); mode "xla" then trains on XLA and continues the
# CPU's checkpoint. (Two processes also because PyTorch's autograd engine sizes
# its per-device queues at the first backward: an XLA backward after CPU ones
# in a process that had not yet imported torch_xla fails an internal assert.)
# ---------------------------------------------------------------------------

def child(mode: str, cache_dir: str, out: str) -> dict:
    sys.path.insert(0, REPO)
    import train
    from nanohlat.run import checkpoint, preflight
    from nanohlat import optim, xla
    from nanohlat import recipe
    from nanohlat import device as devicelib

    def metrics(out_dir) -> dict:
        got = {"loss": {}, "grad_norm": {}, "val_loss": {}}
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            for rec in map(json.loads, f):
                for key in got:
                    if key in rec:
                        got[key][rec["step"]] = rec[key]
        return got

    def run(name, *extra, device="xla"):
        out_dir = os.path.join(out, name)
        argv = BASE + ["--cache-dir", cache_dir, "--out-dir", out_dir, "--device", device] + list(extra)
        model_cfg, tcfg = recipe.parse_args(argv)
        summary = train.train(*preflight.inputs(model_cfg, tcfg))
        return out_dir, summary

    result = {}
    if mode == "cpu":
        cpu_dir, _ = run("cpu", device="cpu")
        run("cpu_half", "--stop-after", "3", device="cpu")   # continued on XLA by the other mode
        return {"cpu": metrics(cpu_dir), "torch_xla_imported_by_cpu_run": "torch_xla" in sys.modules}

    # xla runs, with the number of compiled graphs at the start of every training
    # step (train.py calls zero_grad first: before the step's forward compiles)
    counts: list[int] = []
    original_zero_grad = optim.FlatAdamW.zero_grad

    def counting_zero_grad(self, *args, **kwargs):
        counts.append(xla.compile_count())
        return original_zero_grad(self, *args, **kwargs)

    optim.FlatAdamW.zero_grad = counting_zero_grad
    result["runs"] = {}
    for name, extra in RUNS.items():
        counts.clear()
        out_dir, _ = run(name, *extra)
        result["runs"][name] = metrics(out_dir) | {"compiles_at_step_start": list(counts),
                                                   "compiles_at_end": xla.compile_count()}
    optim.FlatAdamW.zero_grad = original_zero_grad

    # checkpoints across devices: half a run on one device, the rest on the other
    run("xla_half", "--stop-after", "3")
    for first, then, name in (("xla_half", "cpu", "xla_then_cpu"), ("cpu_half", "xla", "cpu_then_xla")):
        out_dir, _ = run(first, "--resume", "auto", device=then)
        result[name] = metrics(out_dir)
    from nanohlat.serving.generate import load_model   # the loader of every command
    cpu_model, _ = load_model(os.path.join(out, "cpu"), devicelib.get_device("cpu"))
    xla_model, _ = load_model(os.path.join(out, "plain"), devicelib.get_device("cpu"))
    xla_weights = dict(xla_model.named_parameters())
    result["max_weight_diff_xla_vs_cpu"] = max(float((p - xla_weights[n]).detach().abs().max())
                                               for n, p in cpu_model.named_parameters())

    # checkpoint snapshots: the nesting kept, the values of the moment (not later in-place updates)
    import torch
    dev = devicelib.get_device("xla")
    w = torch.arange(6.0).to(dev.torch_device) + 1
    dev.sync()
    host = xla.to_host({"w": w, "rest": [w[1:3], (w[2:5], 7)], "none": None})
    w.add_(10)
    dev.sync()
    result["to_host"] = {"types": [type(host["rest"]).__name__, type(host["rest"][1]).__name__],
                         "devices": sorted({t.device.type for t in (host["w"], host["rest"][0], host["rest"][1][0])}),
                         "values": [host["w"].tolist(), host["rest"][0].tolist(), host["rest"][1][0].tolist()],
                         "others": [host["rest"][1][1], host["none"]]}

    # what neuron_parallel_compile's trial run sees (with an lr that makes every step NaN)
    os.environ["NEURON_EXTRACT_GRAPHS_ONLY"] = "1"
    out_dir, summary = run("extract", "--lr", "1e30", "--min-lr", "0", "--max-bad-steps", "2")
    del os.environ["NEURON_EXTRACT_GRAPHS_ONLY"]
    result["extract_graphs_only"] = {"step": summary["step"], "checkpoints": checkpoint.list_checkpoints(out_dir)}
    return result


if __name__ == "__main__":
    print(json.dumps(child(*sys.argv[1:4])))


# -- micro-batches do not multiply the graphs (issue 12) ------------------------------
# Each micro-batch is its own device tensor and ends with a graph cut
# (pipeline.PipelineRunner.run), so --microbatches 8 compiles the same graphs
# as --microbatches 1: same count, about the same compile time (before the
# cut, all 8 forward/backward passes unrolled into one graph: 2.3x the time).

MICROBATCH_CHILD = """
import json, sys
import train
from nanohlat import recipe
from nanohlat.run import preflight
import torch_xla.debug.metrics as met
train.train(*preflight.inputs(*recipe.parse_args(sys.argv[1:])))
count, total_ns = met.metric_data("CompileTime")[:2]
print(json.dumps({"graphs": count, "compile_s": total_ns / 1e9}))
"""


def test_microbatches_compile_the_same_graphs_as_one(cache_dir, tmp_path):
    got = {}
    for m in (1, 8):
        argv = ["--preset", "tiny", "--steps", str(STEPS), "--batch-size", "8", "--seq-len", "32",
                "--warmup-steps", "2", "--eval-every", "0", "--no-progress", "--device", "xla",
                "--microbatches", str(m), "--cache-dir", cache_dir, "--out-dir", str(tmp_path / f"m{m}")]
        proc = subprocess.run([sys.executable, "-c", MICROBATCH_CHILD] + argv, cwd=REPO, env=child_env(),
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got[m] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got[8]["graphs"] == got[1]["graphs"], got
    assert got[8]["compile_s"] <= 1.5 * got[1]["compile_s"], got


def test_bench_runs_the_xla_engine():
    """`python -m nanohlat.bench --engines eager,xla` times nanohlat on the xla device
    beside the eager CPU step, and counts the xla engine's graphs."""
    cmd = [sys.executable, "-m", "nanohlat.bench", "--n-layers", "1", "--d-model", "64", "--n-heads", "2",
           "--n-kv-heads", "2", "--ffn-dim", "128", "--vocab-size", "256", "--seq-len", "32", "--batch-size", "2",
           "--steps", "3", "--warmup", "2", "--threads", "1", "--no-hf", "--engines", "eager,xla",
           "--device", "cpu"]   # (PJRT_DEVICE is set: --device auto would pick xla for the eager engine too)
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.startswith("nanohlat")}
    assert set(rows) == {"nanohlat", "nanohlat-xla"}, proc.stdout
    assert rows["nanohlat"][-6:-4] == ["-", "-"], proc.stdout      # eager: no graphs, then fwd+bwd, optimizer
    graphs, recompiled = (int(x) for x in rows["nanohlat-xla"][-2:])   # xla: no fwd+bwd split
    assert graphs > 0 and recompiled == 0, proc.stdout
    assert "on cpu (1 threads)" in proc.stdout


def test_zb_h1_on_xla_gives_the_cpu_losses_with_graphs_independent_of_the_micro_batches(cache_dir, tmp_path):
    """--schedule zb-h1 (one stage: F, B, W per micro-batch, a graph cut after B and after W) on
    XLA: the eager CPU's losses, and as many compiled graphs for 8 micro-batches as for 1."""
    argv = ["--preset", "tiny", "--steps", str(STEPS), "--batch-size", "8", "--seq-len", "32", "--warmup-steps", "2",
            "--eval-every", "0", "--no-progress", "--schedule", "zb-h1", "--cache-dir", cache_dir]
    got = {}
    for m in (1, 8):
        proc = subprocess.run([sys.executable, "-c", MICROBATCH_CHILD] + argv + [
                              "--device", "xla", "--microbatches", str(m), "--out-dir", str(tmp_path / f"m{m}")],
                              cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got[m] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got[8]["graphs"] == got[1]["graphs"], got
    proc = subprocess.run([sys.executable, "train.py"] + argv + ["--device", "cpu", "--microbatches", "8",
                          "--out-dir", str(tmp_path / "cpu")], cwd=REPO, env=child_env(), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]

    def losses(out):
        with open(out / "metrics.jsonl") as f:
            return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}
    assert not close(losses(tmp_path / "m8"), losses(tmp_path / "cpu"), LOSS_TOL)
