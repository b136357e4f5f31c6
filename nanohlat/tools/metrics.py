"""Metrics: FLOPs per token, model FLOPs utilisation (MFU), tokens/s, the
bytes a rank keeps: what a training step is measured in. run/trainlog.py
reports them for a run, the bench (bench/bench.py) for its steps, and
plan/ predicts them before a run.

MFU (PaLM, Chowdhery et al. 2022, appendix B) is the fraction of the hardware's
peak that the *model's* arithmetic would need at the measured token rate:

    MFU = tokens_per_s * flops_per_token / (peak FLOP/s per device * devices)

Recomputation from activation checkpointing is deliberately not counted (that
would be "hardware FLOPs utilisation"), so checkpointing lowers MFU, as it
should: the recomputed work produces nothing new.
"""

from __future__ import annotations

import collections
import os
import sys
import time

import torch

from nanohlat.config import UserError

# Peak dense FLOP/s of ONE device as nanohlat counts devices: one process each.
# Numbers are vendor datasheet figures, without structured sparsity.
#
# - NeuronCore-v2 (trn1): a Trainium chip has 2 NeuronCore-v2 and delivers
#   190 BF16 TFLOP/s and 47.5 FP32 TFLOP/s (AWS Neuron docs, "Trainium
#   Architecture"; trn1.32xlarge: 16 chips = 3,040 / 760). We run one process
#   per NeuronCore, hence half a chip each.
# - A100 (SXM/PCIe): 312 BF16 tensor-core TFLOP/s; 19.5 FP32 without tensor
#   cores. PyTorch leaves TF32 matmuls off by default, so "fp32" means 19.5;
#   a run that turns TF32 on would peak at 156 (NVIDIA A100 datasheet).
# - H100 SXM: 989 BF16 dense TFLOP/s, 67 FP32 (NVIDIA H100 datasheet).
# - H200: the same GH100 compute as the H100 SXM (more and faster memory only).
# - cpu: there is no datasheet; this is a *measured* per-core figure, by the
#   one definition train.py and bench.py use too (`measure_cpu_peak`): on a
#   quiet 2-core development machine it read ~190 GFLOP/s with both cores,
#   i.e. ~95 GFLOP/s per core. bf16 on CPUs without AMX/AVX512-BF16 is not
#   faster, so we use the same figure. It is per core and scaled by the
#   threads in use (`peak_flops`). It serves `--plan`'s estimates only: a CPU
#   *run* measures its own machine instead (`device_peak`).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "NeuronCore-v2": {"bf16": 190e12 / 2, "fp32": 47.5e12 / 2},
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
    "H100": {"bf16": 989e12, "fp32": 67e12},
    "H200": {"bf16": 989e12, "fp32": 67e12},
    "cpu": {"bf16": 95e9, "fp32": 95e9},  # per core, see above
}

# FP8 matmul peaks of one process where a device has them (--fp8's linears: plan/fp8_costs.py): the H100 and
# H200 SXM, 1,979 dense TFLOP/s (NVIDIA datasheets: 3,958 with sparsity); trn1 computes cFP8 at its BF16
# rate (AWS Neuron docs, "Trainium Architecture": 190 FP16/BF16/cFP8/TF32 TFLOPS a chip, two cores), so FP8
# buys it no arithmetic (Trainium2: 1,299 FP8 against 667 BF16 a chip, "Trainium2 Architecture"). The A100
# has no FP8 tensor cores; the CPU only emulates it (beyond/fp8.py).
FP8_FLOPS: dict[str, float] = {"NeuronCore-v2": 190e12 / 2, "H100": 1979e12, "H200": 1979e12}

# --precision -> which datasheet column the matmuls run at. In bf16-mixed the
# forward/backward matmuls are bf16 (only the master weights and optimizer are
# fp32), so its peak is the bf16 one.
_PRECISION_COLUMN = {"fp32": "fp32", "bf16-mixed": "bf16", "bf16-sr": "bf16", "bf16": "bf16"}


def active_params(model_cfg) -> int:
    """The parameters a token's forward uses: all of a dense model's; with experts, the
    dense part, its k experts (+ the shared ones) and the router of each sparse layer."""
    return model_cfg.num_params() - model_cfg.moe_extra_params() + model_cfg.moe_extra_params(active=True)


def flops_per_token(model_cfg, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token, the PaLM appendix B count.

    Dense part: every weight that takes part in a matmul costs 2 FLOPs per token
    forward (multiply + add) and 4 backward (gradient w.r.t. input and w.r.t.
    weight): 6 * N. The input embedding is a table lookup, not a matmul, so it
    is excluded; the output head is a matmul and is included. RMSNorm weights
    and elementwise work are negligible and not counted. With experts, N counts
    the parameters a token uses (its k experts, the shared ones, the router).

    Attention part: QK^T and softmax(.)V are matmuls with no weights, each
    2 * seq_len * d_model FLOPs per token per layer forward, times 3 for
    forward + backward: 12 * n_layers * d_model * seq_len. (With grouped-query
    attention Q still has n_heads * head_dim = d_model columns, so the count is
    unchanged.) Like PaLM, Megatron-LM and nanoGPT we count the full seq x seq
    score matrix even though the causal mask makes half of it useless, so our
    MFU is comparable to theirs; a kernel that skips the masked half does less
    work than we count, which makes MFU look slightly better than its FLOPs.
    """
    d, L = model_cfg.d_model, model_cfg.n_layers
    per_layer = model_cfg.layer_matrix_params()   # wq wo wk wv + gate up down
    # The head multiplies by the padded vocabulary, so the padded columns are
    # real work the device does (and 32000 is already a multiple of 128).
    head = d * model_cfg.padded_vocab
    # a mixture of experts (moe.py): a token goes through its k experts (+ the shared ones) and the router
    n_matmul = L * per_layer + head + model_cfg.moe_extra_params(active=True)
    return 6.0 * n_matmul + 12.0 * L * d * seq_len


def peak_flops(device_name: str, precision: str, threads: int | None = None) -> float | None:
    """Peak FLOP/s of one process on `device_name` at `precision`, or None if unknown.

    On the CPU the figure scales with the threads this process computes with
    (default: torch.get_num_threads()), since the table holds a per-core rate.
    """
    if precision not in _PRECISION_COLUMN:
        raise UserError(f"--precision {precision!r} is not one of {', '.join(_PRECISION_COLUMN)}")
    row = PEAK_FLOPS.get(device_name)
    if row is None:
        return None  # 'unknown' device: MFU is not reported rather than guessed
    peak = row[_PRECISION_COLUMN[precision]]
    if device_name == "cpu":
        peak *= threads if threads is not None else torch.get_num_threads()
    return peak


# The matmuls measure_cpu_peak times: (n, repeats) for n x n x n fp32. The
# large size matters: 1024^3 is over in ~10 ms, too short for every core's
# thread to be busy the whole time (it read anywhere from 100 to 190 GFLOP/s
# on a 2-core machine where 2048^3 reads ~190), and a training step of the
# default preset beat it: MFU above 100%.
CPU_PEAK_MATMULS = ((1024, 5), (2048, 3))


def _best_matmul_rate() -> float:
    best = 0.0
    for n, repeats in CPU_PEAK_MATMULS:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b                                          # warm-up: thread pool, caches
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = max(best, 2.0 * n ** 3 / (time.perf_counter() - start))
    return best


_cpu_peaks: dict[int, float] = {}   # threads -> the best matmul rate measured so far in this process


def measure_cpu_peak() -> float:
    """This process's fp32 matmul rate in FLOP/s with its current threads: the
    best over CPU_PEAK_MATMULS, measured once per process and thread count
    (and raised by any later `resample_cpu_peak`).

    CPUs have no datasheet figure that a training step could approach, and a
    stated one is wrong on the next machine (MFU above 100% on a faster CPU,
    the nanoGPT-on-H100 mistake). So a CPU run measures its own ceiling: the
    operation that dominates a training step, at sizes large enough to keep
    every core busy.
    """
    threads = torch.get_num_threads()
    if threads not in _cpu_peaks:
        with torch.random.fork_rng(devices=[]):   # (its random matrices: not from the run's CPU generator, which
            _cpu_peaks[threads] = _best_matmul_rate()   # a checkpoint saves; once drawn in a process's first run)
    return _cpu_peaks[threads]


def resample_cpu_peak() -> float:
    """Measure the CPU's matmul rate again and keep the best seen. The bench
    calls it between its rounds: on a shared machine, whose speed can swing
    2x from one second to the next, the one moment the first measurement saw
    may be a slow one, and every MFU would then be read against too low a
    peak (the same code read 50% and 86% in two runs before this)."""
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):   # its random matrices leave a run's CPU generator as it was
        _cpu_peaks[threads] = max(measure_cpu_peak(), _best_matmul_rate())
    return _cpu_peaks[threads]


def device_peak(device, precision: str) -> float | None:
    """Peak FLOP/s of one process on `device`, the one definition train.py and
    bench.py divide by: measured on the CPU (measure_cpu_peak), the datasheet
    figure elsewhere (PEAK_FLOPS), None for an unknown device."""
    if device.kind == "cpu":
        return measure_cpu_peak()
    return peak_flops(device.name, precision)


def describe_peak(device, precision: str, processes: int = 1) -> str:
    """One line saying what MFU divides by."""
    peak = device_peak(device, precision)
    if not peak:
        return f"mfu: not reported, no peak FLOP/s known for {device.name}"
    how = (f"measured: the best fp32 matmul of sizes {', '.join(str(n) for n, _ in CPU_PEAK_MATMULS)} "
           f"on {torch.get_num_threads()} thread(s), metrics.measure_cpu_peak" if device.kind == "cpu"
           else f"datasheet, {precision}, metrics.PEAK_FLOPS")
    return f"mfu: model FLOP/s over {processes} x {peak / 1e9:,.0f} GFLOP/s peak ({how})"


_mfu_warned = False


def mfu(tokens_per_s: float, flops_per_token: float, peak_total: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over `peak_total`, the
    summed peak of every process that produced those tokens. None if unknown,
    and None (with a warning, once) if above 1: then the peak, not the model,
    is wrong, and the number would teach nothing."""
    global _mfu_warned
    if not peak_total or peak_total <= 0:
        return None
    value = tokens_per_s * flops_per_token / peak_total
    if value > 1.0:
        if not _mfu_warned:
            _mfu_warned = True
            print(f"warning: measured MFU {value:.0%} is above 100%, so the peak ({peak_total / 1e9:,.0f} GFLOP/s "
                  f"in all) is underestimated; MFU is not reported for such steps", file=sys.stderr)
        return None
    return value


class Throughput:
    """Tokens per second over a sliding window of the most recent steps.

    Call `update(tokens)` once per optimizer step, right after it. The first
    call only starts the clock: the first step includes graph compilation on
    XLA (minutes on Neuron) and allocator/thread-pool warm-up elsewhere, and
    would drag the average down for the whole window. Until a second step has
    finished the rate is unknown and None is returned (never 0.0: no run makes
    no tokens).

    On XLA the host runs ahead of the device, so a single step's wall time is
    meaningless; over a window that spans several sync points, the host can be
    at most a step or so ahead, and the average converges to the device rate.
    """

    def __init__(self, window: int = 20):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        # (time at end of step, tokens of that step); one extra entry so that
        # `window` step durations fit between the oldest and newest timestamps.
        self._events: collections.deque[tuple[float, int]] = collections.deque(maxlen=window + 1)

    def update(self, tokens: int, now: float | None = None) -> float | None:
        now = time.perf_counter() if now is None else now
        self._events.append((now, tokens))
        if len(self._events) < 2:
            return None
        elapsed = now - self._events[0][0]
        # The oldest entry's tokens were produced before its timestamp, i.e.
        # outside the measured interval, so they are not counted.
        counted = sum(t for _, t in list(self._events)[1:])
        return counted / elapsed if elapsed > 0 else None


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def optimizer_bytes(opt) -> int:
    """Optimizer state on this rank (optim.FlatAdamW): two moments + master weights if a separate copy."""
    return sum(_nbytes(g.exp_avg) + _nbytes(g.exp_avg_sq) + (0 if g.master_is_params else _nbytes(g.master))
               for g in opt.groups)


def resident_bytes(opt) -> dict:
    """What this rank keeps between steps, by kind (summary.json; plan/memory.py predicts each):
    the parameters' flat buffers, the fp32 gradient buffers, the optimizer state."""
    return {"param_bytes": sum(_nbytes(g.dp_state.param_shard) if g.dp_state.param_shard is not None   # ZeRO-3: kept
                               else _nbytes(g.flat) if g.aliased else sum(_nbytes(p) for p in g.params)
                               for g in opt.groups),   # (xla: no flat buffer kept, optim.FlatGroup)
            "grad_bytes": sum(_nbytes(g.grad) for g in opt.groups), "optimizer_bytes": optimizer_bytes(opt)}


def peak_memory(device) -> int | None:
    """Peak bytes of this process on `device` (a device.Device): CUDA tensor
    allocations; on the CPU the process's peak resident set (everything, not
    only tensors); xla when the runtime reports it (PJRT's CPU client does not)."""
    if device.kind == "cuda":
        return torch.cuda.max_memory_allocated(device.torch_device)
    if device.kind == "cpu":
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if os.uname().sysname == "Darwin" else peak * 1024  # Linux reports KiB
    from nanohlat import xla
    return xla.peak_memory(device.torch_device)
