"""Metrics: FLOPs per token, model FLOPs utilisation (MFU), tokens/s and the
JSONL log every run writes.

MFU (PaLM, Chowdhery et al. 2022, appendix B) is the fraction of the hardware's
peak that the *model's* arithmetic would need at the measured token rate:

    MFU = tokens_per_s * flops_per_token / (peak FLOP/s per device * devices)

Recomputation from activation checkpointing is deliberately not counted (that
would be "hardware FLOPs utilisation"), so checkpointing lowers MFU, as it
should: the recomputed work produces nothing new.
"""

from __future__ import annotations

import collections
import json
import os
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
# - cpu: there is no datasheet; this is a *measured* per-core figure. A 2-core
#   development machine ran fp32 matmuls at ~106 GFLOP/s with torch on both
#   cores, i.e. ~53 GFLOP/s per core. bf16 on CPUs without AMX/AVX512-BF16 is
#   not faster, so we use the same figure. It is per core and scaled by the
#   threads in use (`peak_flops`). It serves `--plan`'s estimates only: a CPU
#   *run* measures its own matmul rate instead (`measure_cpu_peak`).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "NeuronCore-v2": {"bf16": 190e12 / 2, "fp32": 47.5e12 / 2},
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
    "H100": {"bf16": 989e12, "fp32": 67e12},
    "H200": {"bf16": 989e12, "fp32": 67e12},
    "cpu": {"bf16": 53e9, "fp32": 53e9},  # per core, see above
}

# --precision -> which datasheet column the matmuls run at. In bf16-mixed the
# forward/backward matmuls are bf16 (only the master weights and optimizer are
# fp32), so its peak is the bf16 one.
_PRECISION_COLUMN = {"fp32": "fp32", "bf16-mixed": "bf16", "bf16-sr": "bf16", "bf16": "bf16"}


def flops_per_token(model_cfg, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token, the PaLM appendix B count.

    Dense part: every weight that takes part in a matmul costs 2 FLOPs per token
    forward (multiply + add) and 4 backward (gradient w.r.t. input and w.r.t.
    weight): 6 * N. The input embedding is a table lookup, not a matmul, so it
    is excluded; the output head is a matmul and is included. RMSNorm weights
    and elementwise work are negligible and not counted.

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
    kv = model_cfg.n_kv_heads * model_cfg.head_dim
    per_layer = (d * d * 2 + d * kv * 2) + 3 * d * model_cfg.ffn_dim  # wq wo wk wv + gate up down
    # The head multiplies by the padded vocabulary, so the padded columns are
    # real work the device does (and 32000 is already a multiple of 128).
    head = d * model_cfg.padded_vocab
    n_matmul = L * per_layer + head
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


def measure_cpu_peak(n: int = 1024, repeats: int = 20) -> float:
    """This process's fp32 matmul rate in FLOP/s, measured now with its threads.

    CPUs have no datasheet figure that a training step could approach, and a
    stated one is wrong on the next machine (MFU above 100% on a faster CPU,
    the nanoGPT-on-H100 mistake). So a CPU run measures its own ceiling: the
    best of a few n x n matmuls, the operation that dominates a training step.
    """
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b                                              # warm-up: thread pool, caches
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2.0 * n ** 3 / best


def mfu(tokens_per_s: float, flops_per_token: float, peak_total: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over `peak_total`, the
    summed peak of every process that produced those tokens. None if unknown."""
    if not peak_total or peak_total <= 0:
        return None
    return tokens_per_s * flops_per_token / peak_total


class MetricsWriter:
    """Appends one JSON object per line to metrics.jsonl.

    Append mode, so a resumed run continues the same file; a flush after every
    line, so `tail -f` and a crash both see every completed record. Floats are
    written with Python's shortest round-trip repr, i.e. at full precision:
    the layout-equivalence tests compare logged losses bit for bit.

    Only plain Python values belong in a record. Reading a device tensor here
    would force a host sync on XLA; log from a step closure instead
    (Device.add_step_closure), where the values have already been computed.
    """

    def __init__(self, path: str):
        if os.path.isdir(path):  # accept the run's out_dir as well as the file
            path = os.path.join(path, "metrics.jsonl")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self._file = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, default=_to_python) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _to_python(value):
    # numpy scalars and 0-d CPU tensors have .item(); anything else is a bug.
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"metrics record value of type {type(value).__name__} is not JSON-serialisable")


class Throughput:
    """Tokens per second over a sliding window of the most recent steps.

    Call `update(tokens)` once per optimizer step, right after it. The first
    call only starts the clock: the first step includes graph compilation on
    XLA (minutes on Neuron) and allocator/thread-pool warm-up elsewhere, and
    would drag the average down for the whole window. Until a second step has
    finished the rate is unknown and 0.0 is returned.

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

    def update(self, tokens: int, now: float | None = None) -> float:
        now = time.perf_counter() if now is None else now
        self._events.append((now, tokens))
        if len(self._events) < 2:
            return 0.0
        elapsed = now - self._events[0][0]
        # The oldest entry's tokens were produced before its timestamp, i.e.
        # outside the measured interval, so they are not counted.
        counted = sum(t for _, t in list(self._events)[1:])
        return counted / elapsed if elapsed > 0 else 0.0


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
