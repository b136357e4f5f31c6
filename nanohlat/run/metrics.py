"""Metrics: FLOPs per token, model FLOPs utilisation (MFU), tokens/s, the
JSONL log every run writes (cut back to the checkpoint's step on resume:
truncate_metrics), and `TrainLog`, everything train.py reports.

MFU (PaLM, Chowdhery et al. 2022, appendix B) is the fraction of the hardware's
peak that the *model's* arithmetic would need at the measured token rate:

    MFU = tokens_per_s * flops_per_token / (peak FLOP/s per device * devices)

Recomputation from activation checkpointing is deliberately not counted (that
would be "hardware FLOPs utilisation"), so checkpointing lowers MFU, as it
should: the recomputed work produces nothing new.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
import time

import torch

from nanohlat.run import files
from nanohlat.run.checkpoint.history import set_aside_newer
from nanohlat import config, xla
from nanohlat.config import UserError
from nanohlat.mesh import layout_table

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
    per_layer = model_cfg.layer_matrix_params()   # wq wo wk wv + gate up down
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
        _cpu_peaks[threads] = _best_matmul_rate()
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


class MetricsWriter:
    """Appends one JSON object per line to metrics.jsonl.

    Append mode, so a resumed run continues the same file; a flush after every
    line, so `tail -f` and a crash both see every completed record. Floats are
    written with Python's shortest round-trip repr, i.e. at full precision:
    the layout-equivalence tests compare logged losses bit for bit. The file is
    strict JSON: a value that is not finite (the grad_norm of a step that
    overflowed) is the string "NaN", "Infinity" or "-Infinity" (files.json_text).

    Only plain Python values belong in a record. Reading a device tensor here
    would force a host sync on XLA; log from a step closure instead
    (Device.add_step_closure), where the values have already been computed.
    """

    def __init__(self, path: str):
        if os.path.isdir(path):  # accept the run's out_dir as well as the file
            path = os.path.join(path, "metrics.jsonl")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self._file = files.open_append(path)    # never through a link at the name

    def write(self, record: dict) -> None:
        try:
            self._file.write(files.json_text(record, default=_to_python) + "\n")
            self._file.flush()
        except OSError as e:   # (a full disk): the file's own error names no file
            if not isinstance(e.filename, str):
                e.filename = self.path
            raise

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def truncate_metrics(path: str, step: int) -> None:
    """Drop metrics.jsonl records after `step` (written by a run that was then
    interrupted before its next checkpoint), so a resumed run continues cleanly.
    A run that went back to an older checkpoint first moves the newer ones, and
    these records, aside (set_aside_newer)."""
    set_aside_newer(os.path.dirname(path) or ".", step + 1)
    if not os.path.isfile(path):
        return
    keep, damaged = [], 0
    with open(path, "rb") as f:
        for raw in f:
            # Policy: a line that is not a JSON record with a whole-number step
            # (cut short by a crash, or damaged: not UTF-8, not an object) is dropped
            # with a note. It is a log, not state: training resumes from the
            # checkpoint either way, and no step of a damaged line can be trusted.
            try:
                line = raw.decode()
                record = json.loads(line)
                rec_step = record.get("step", 0) if isinstance(record, dict) else None
                if not isinstance(rec_step, int) or isinstance(rec_step, bool):
                    raise ValueError("no step")
            except ValueError:      # UnicodeDecodeError and JSONDecodeError are ValueErrors
                damaged += raw.strip() != b""
                continue
            if rec_step <= step:
                keep.append(line if line.endswith("\n") else line + "\n")
    if damaged:
        print(f"note: {path}: {damaged} damaged line(s) (cut short by a crash, or not JSON records) dropped "
              f"on resume; the checkpoint holds the training state", file=sys.stderr)
    files.atomic_write(path, lambda f: f.write("".join(keep).encode()))


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


class TrainLog:
    """What a training run reports, kept beside train()'s loop instead of inside it.

    Every rank counts non-finite steps (so that all ranks stop together on the
    same step) and keeps a summary; rank 0 also prints, draws the progress bar
    and writes the run's record in out-dir: config.json (at the start),
    metrics.jsonl (one row per logged step and per evaluation) and
    summary.json (at the end: what `--plan` predicts, as measured).

    The device rules hold here too: nothing reads a device tensor during a
    step. `count` adds to counters on the device, inside the step's graph;
    `step` and `val` queue their host reads as step closures
    (Device.add_step_closure), which run once the values exist.
    """

    def __init__(self, model_cfg, tcfg, mesh, dev, model, opt, tokenizer_path: str,
                 start_step: int = 0, bad_steps: int = 0, resumed_from: str | None = None):
        self.tcfg, self.dev = tcfg, dev
        self.main = mesh.rank == 0
        self.print = print if self.main else (lambda *a, **k: None)
        self.path = os.path.join(tcfg.out_dir, "metrics.jsonl")
        self.summary = {"losses": [], "val_losses": []}
        self.last_step = start_step
        if resumed_from:
            self.print(f"resumed from {resumed_from} at step {start_step}")
        if self.main:
            os.makedirs(tcfg.out_dir, exist_ok=True)
            run_cfg = config.to_dict(model_cfg, tcfg) | {"world": mesh.world, "dp": mesh.dp,
                                                          "tokenizer_path": tokenizer_path}
            files.write_text(os.path.join(tcfg.out_dir, "config.json"), files.json_text(run_cfg, indent=2))
            truncate_metrics(self.path, start_step)
            self.print(layout_table(mesh.tp, mesh.pp, mesh.dp, model_cfg.n_layers, max_rows=16,
                                    v=tcfg.virtual_stages))
            self.print(f"model: {model_cfg.num_params() / 1e6:.2f}M parameters; this rank: "
                       f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M; optimizer state on this rank: "
                       f"{optimizer_bytes(opt) / 2**20:.1f} MiB ({f'ZeRO-{tcfg.zero}' if tcfg.zero else 'replicated'})")
        self.writer = MetricsWriter(self.path) if self.main else None
        self.write_failed: str | None = None   # a row metrics.jsonl could not take (`_write`)

        self.tokens_per_step = tcfg.batch_size * tcfg.seq_len
        self.flops_tok = flops_per_token(model_cfg, tcfg.seq_len)
        # CPUs: the matmul rate measured on this process's threads (device_peak)
        peak = device_peak(dev, tcfg.precision)
        self.peak_total = peak * mesh.world if peak else None
        self.world, self.resampled_at = mesh.world, None   # (of the CPU peak: _mfu)
        self.meter = Throughput()
        # neuron_parallel_compile runs the script on zeros, not values: nothing to judge then
        self.judge = not xla.extract_graphs_only()
        # Non-finite steps, counted on the device (no host sync per step): the
        # current run of them, the longest run and how many in all. The host looks
        # at them when a step is logged (`_log_step`). They are never reset in
        # the loop: a reset after a logged step would feed that step's successor
        # constants where the others get device data, i.e. a second step graph to
        # compile on XLA (with --log-every > 1, and after every checkpoint).
        self.bad_streak = torch.full((), float(bad_steps), device=dev.torch_device)
        self.worst_streak, self.skipped = self.bad_streak.clone(), torch.zeros((), device=dev.torch_device)
        self.skipped_logged = 0   # `skipped` at the previous log (host side)
        self.bar = None
        if self.main and tcfg.progress:
            self.print(describe_peak(dev, tcfg.precision, mesh.world))   # what the bar's mfu divides by
            from tqdm import tqdm
            self.bar = tqdm(total=tcfg.steps, initial=start_step, desc="train", dynamic_ncols=True)

    def count(self, finite: torch.Tensor) -> None:
        """Inside the step, before its sync: one more step, finite or not."""
        self.bad_streak = torch.where(finite, torch.zeros_like(self.bad_streak), self.bad_streak + 1)
        self.worst_streak = torch.maximum(self.worst_streak, self.bad_streak)
        self.skipped = self.skipped + (self.bad_streak > 0).float()

    def bad_steps(self) -> int:
        """The current run of non-finite steps (a checkpoint keeps it; a host read)."""
        return int(self.bad_streak)

    def comm(self, measured: dict, report: str) -> None:
        """The first step's communication (CommLedger.summary: payload, wire and
        padding bytes and calls per collective, for summary.json) and its report (printed)."""
        self.summary.update(measured)
        self.print(report)

    def step(self, step: int, loss, norm, lr: float, tokens: int, last: bool = False) -> None:
        """After the step's sync: on a step to log (every --log-every, and the
        run's last), queue the host's look at its values; move the bar on."""
        self.last_step = step
        if self.bar:
            self.bar.update(1)
        if step % self.tcfg.log_every == 0 or last:
            self.dev.add_step_closure(self._log_step, step, loss, norm, self.worst_streak, self.skipped, lr,
                                      tokens, last)

    def _log_step(self, step, loss, norm, worst, skipped, lr, tokens, last):
        """Runs once the step's values exist (a step closure on XLA: no host sync in the step)."""
        tcfg = self.tcfg
        loss, norm = float(loss), float(norm)
        worst, skipped_total = (int(worst), int(skipped)) if self.judge else (0, 0)
        skipped, self.skipped_logged = skipped_total - self.skipped_logged, skipped_total   # since the last log
        if skipped and self.main:   # the optimizer already skipped their updates (optim.py:FlatAdamW.update)
            what = (f"step {step} had" if tcfg.log_every == 1 else
                    f"{skipped} step(s) since the last log (up to step {step}) had")
            print(f"warning: {what} a non-finite loss or gradient; the update was skipped", file=sys.stderr)
        tps = self.meter.update(self.tokens_per_step)
        mfu_ = self._mfu(tps) if self.main else None
        self.summary["losses"].append(loss)
        self._write({"step": step, "loss": loss, "lr": lr, "grad_norm": norm, "tokens": tokens,
                     "tokens_per_s": tps, "mfu": mfu_})
        if self.bar:
            # unknown is "?", never 0%: no rate yet (the first step is not timed: Throughput), or no
            # peak to divide by (the reason is printed once: describe_peak, or mfu's warning)
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tps:,.0f}" if tps else "?",
                                 mfu="?" if mfu_ is None or not tps else f"{mfu_ * 100:.1f}%")
            if last:   # before anything else is printed (the timeline, the last line)
                self.bar.close()
        if 0 < tcfg.max_bad_steps <= worst:   # (0: never stop) every rank sees the same counts: all stop together
            raise UserError(f"{worst} steps in a row had a non-finite loss or gradient (by step {step}); "
                            f"stopping at --max-bad-steps {tcfg.max_bad_steps}. Lower --lr or check the "
                            f"data, then resume from a checkpoint saved before the trouble (--resume PATH)")

    def _mfu(self, tps: float) -> float | None:
        """MFU of a logged step. A CPU peak measured once at the start, while the
        machine was busy, can be too low for the rest of the run: when the
        model's rate beats it, the peak is measured again (resample_cpu_peak:
        a few matmuls, ~0.1 s) and the best kept. Only then, and at most once a
        minute, so a quiet machine's run pays nothing and a noisy one little."""
        beaten = self.peak_total and self.dev.kind == "cpu" and tps * self.flops_tok > self.peak_total
        if beaten and (self.resampled_at is None or time.perf_counter() - self.resampled_at > 60):
            self.peak_total, self.resampled_at = resample_cpu_peak() * self.world, time.perf_counter()
        return mfu(tps, self.flops_tok, self.peak_total)

    def val(self, step: int, val_loss: torch.Tensor) -> None:
        """A validation loss, read on the host once it exists."""
        self.dev.add_step_closure(self._log_val, step, val_loss)

    def _log_val(self, step, val_loss):
        self.summary["val_losses"].append(float(val_loss))
        self._write({"step": step, "val_loss": float(val_loss)})

    def _write(self, record: dict) -> None:
        """A row of metrics.jsonl (rank 0). A write that fails (a full disk) does not end
        the run at once: the row is lost, but the steps trained are not. The failure is
        kept in `write_failed`, and every rank stops at the next stop vote and saves
        a checkpoint; then rank 0 ends with one line saying both (Session.end_step)."""
        if not self.writer:
            return
        try:
            self.writer.write(record)
        except OSError as e:
            self.write_failed = f"cannot write {e.filename!r}: {e.strerror or e}"
            with contextlib.suppress(OSError):
                self.writer.close()
            self.writer = None

    def close(self, **measured) -> dict:
        """The end of the run: summary.json and the last line (rank 0). Returns the summary."""
        if self.bar:
            self.bar.close()
        self.summary.update(measured, step=self.last_step)
        if self.main:   # what the plan predicted, as measured on rank 0 (tests compare the two)
            keys = ("comm_bytes", "comm_wire_bytes", "comm_padding_bytes", "comm_calls", "param_bytes",
                    "grad_bytes", "optimizer_bytes", "peak_in_flight", "peak_memory", "step")
            files.write_text(os.path.join(self.tcfg.out_dir, "summary.json"),
                             files.json_text({k: self.summary.get(k) for k in keys}, indent=2))
        if self.writer:
            self.writer.close()
            if self.tcfg.compile:   # what torch.compile made of the step (tutorial chapter 2)
                from nanohlat.tools import compile as compilelib
                st = compilelib.stats()
                self.print(f"torch.compile on rank 0: {st['graphs']} graphs compiled, "
                           f"{st['graph_breaks']} graph breaks")
            losses, vals = self.summary["losses"], self.summary["val_losses"]
            if not losses:   # resumed at (or past) --steps: nothing was trained
                self.print(f"done: nothing to train, the run in {self.tcfg.out_dir} is already at step "
                           f"{self.last_step} of --steps {self.tcfg.steps} (raise --steps to go on)")
            else:
                self.print(f"done: {self.last_step} steps, final loss {losses[-1]:.4f}"
                           + (f", val loss {vals[-1]:.4f}" if vals else "") + f"; metrics in {self.path}")
        return self.summary


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def optimizer_bytes(opt) -> int:
    """Optimizer state on this rank (optim.FlatAdamW): two moments + master weights if a separate copy."""
    return sum(_nbytes(g.exp_avg) + _nbytes(g.exp_avg_sq) + (0 if g.master_is_params else _nbytes(g.master))
               for g in opt.groups)


def resident_bytes(opt) -> dict:
    """What this rank keeps between steps, by kind (summary.json; tools/plan.py predicts each):
    the parameters' flat buffers, the fp32 gradient buffers, the optimizer state."""
    return {"param_bytes": sum(_nbytes(g.param_shard) if g.param_shard is not None   # ZeRO-3: the shard kept
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
