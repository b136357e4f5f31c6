"""The run's record: `TrainLog`, everything train.py reports (prints, the
progress bar, config.json, metrics.jsonl, summary.json and report.html), the
`MetricsWriter` of metrics.jsonl, and metrics.jsonl cut back to the
checkpoint's step on resume (`truncate_metrics`). What it reports is measured
by tools/metrics.py (tokens/s, MFU, bytes).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import torch

from nanohlat import comm, xla
from nanohlat import recipe
from nanohlat.config import UserError
from nanohlat.plan.sheets import layout_table
from nanohlat.run.report import write_quietly as write_report
from nanohlat.run.checkpoint.history import set_aside_newer
from nanohlat.system import files
from nanohlat.tools.metrics import (Throughput, active_params, describe_peak, device_peak, flops_per_token, mfu,
                                    optimizer_bytes, resample_cpu_peak)


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
            self._file.write(files.json_text(record) + "\n")
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
                rec_step = record.get("step") if isinstance(record, dict) else None   # (no step: damaged)
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



def comm_summary(ledger) -> dict:
    """The comm ledger's four figures as summary.json holds them: comm_bytes (the payload),
    comm_wire_bytes, comm_padding_bytes, comm_calls; each {key: bytes or calls}."""
    names = {"payload": "comm_bytes", "wire": "comm_wire_bytes", "padding": "comm_padding_bytes",
             "calls": "comm_calls"}
    return {names[f]: ledger.snapshot(f) for f in comm.FIGURES}

class TrainLog:
    """What a training run reports, kept beside train()'s loop instead of inside it.

    Every rank counts non-finite steps (so that all ranks stop together on the
    same step) and keeps a summary; rank 0 also prints, draws the progress bar
    and writes the run's record in out-dir: config.json (at the start),
    metrics.jsonl (one row per logged step and per evaluation),
    summary.json (at the end: what `--plan` predicts, as measured) and
    report.html (at each evaluation and at the end: the figures of all
    of them, run/report.py).

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
        self.summary, self.router_loss = {"losses": [], "val_losses": []}, None
        self.last_step = start_step
        if resumed_from:
            self.print(f"resumed from {resumed_from} at step {start_step}")
        if self.main:
            os.makedirs(tcfg.out_dir, exist_ok=True)
            run_cfg = recipe.to_dict(model_cfg, tcfg) | {"world": mesh.world, "dp": mesh.dp,
                                                          "tokenizer_path": tokenizer_path,
                                                          "device_kind": dev.kind, "device_name": dev.name}
            files.write_text(os.path.join(tcfg.out_dir, "config.json"), files.json_text(run_cfg, indent=2))
            truncate_metrics(self.path, start_step)
            self.print(layout_table(mesh.tp, mesh.pp, mesh.dp, model_cfg.n_layers, max_rows=16, cp=tcfg.cp,
                                    v=tcfg.virtual_stages))
            active = active_params(model_cfg)
            sparse = (f" ({active / 1e6:.2f}M active per token: the top-{model_cfg.moe_top_k} of "
                      f"{model_cfg.moe_experts} experts)" if model_cfg.moe_experts else "")
            self.print(f"model: {model_cfg.num_params() / 1e6:.2f}M parameters{sparse}; this rank: "
                       f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M; optimizer state on this rank: "
                       f"{optimizer_bytes(opt) / 2**20:.1f} MiB ({f'ZeRO-{tcfg.zero}' if tcfg.zero else 'replicated'}"
                       f"{f'; experts over ep {tcfg.ep}' if tcfg.ep > 1 else ''})")
        self.writer = MetricsWriter(self.path) if self.main else None
        self.write_failed: str | None = None   # a row metrics.jsonl could not take (`_write`)
        self.stopped: str | None = None        # why the run stops itself (--max-bad-steps: `_log_step`)

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
        """The first step's communication (comm_summary: payload, wire and
        padding bytes and calls per collective, for summary.json) and its report (printed)."""
        self.summary.update(measured)
        self.print(report)

    def step(self, step: int, loss, norm, lr: float, tokens: int, last: bool = False, extra: dict | None = None) -> None:
        """After the step's sync: on a step to log (every --log-every, and the
        run's last), queue the host's look at its values; move the bar on."""
        self.last_step = step
        if self.bar:
            self.bar.update(1)
        if step % self.tcfg.log_every == 0 or last:
            self.dev.add_step_closure(self._log_step, step, loss, norm, self.worst_streak, self.skipped, lr,
                                      tokens, last, extra or {})

    def _log_step(self, step, loss, norm, worst, skipped, lr, tokens, last, extra):
        """Runs once the step's values exist (a step closure on XLA: no host sync in the step)."""
        tcfg = self.tcfg
        loss, norm = float(loss), float(norm)
        worst, skipped_total = (int(worst), int(skipped)) if self.judge else (0, 0)
        skipped, self.skipped_logged = skipped_total - self.skipped_logged, skipped_total   # since the last log
        if skipped and self.main:   # the optimizer already skipped their updates (optim.py:FlatAdamW.update)
            what = (f"step {step} had" if tcfg.log_every == 1 else
                    f"{skipped} step(s) since the last log (up to step {step}) had")
            print(f"warning: {what} a non-finite loss or gradient; the update was skipped", file=sys.stderr)
        tps = self.meter.update(self.tokens_per_step)   # None: not timed yet (the first step: Throughput)
        mfu_ = self._mfu(tps) if self.main and tps is not None else None
        self.summary["losses"].append(loss)
        self.router_loss = extra.get("moe_router_loss")   # a mixture's router losses, logged beside the loss
        # unknown is null in the record and "?" on the bar, never 0: no rate yet, or no peak to
        # divide by (the reason is printed once: describe_peak, or mfu's warning)
        self._write({"step": step, "loss": loss, "lr": lr, "grad_norm": norm, "tokens": tokens,
                     "tokens_per_s": tps, "mfu": mfu_, **extra})   # extra: the model's own figures (a MoE's)
        if self.bar:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s="?" if tps is None else f"{tps:,.0f}",
                                 mfu="?" if mfu_ is None else f"{mfu_ * 100:.1f}%")
            if last:   # before anything else is printed (the timeline, the last line)
                self.bar.close()
        if 0 < tcfg.max_bad_steps <= worst and self.stopped is None:   # (0: never stop) every rank sees the same
            # counts, so all stop together: Session.end_step saves the last good step, then says this
            self.stopped = (f"{worst} steps in a row had a non-finite loss or gradient (by step {step}); "
                            f"stopping at --max-bad-steps {tcfg.max_bad_steps}")

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
        if self.writer:   # rank 0, its records written: the page drawn from them (a failure costs no step)
            write_report(self.tcfg.out_dir)

    def record(self, record: dict) -> None:
        """A row of metrics.jsonl that is no step's figures (run/restarts.py's: a restart, its cost)."""
        self._write(record)

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
                    "grad_bytes", "optimizer_bytes", "peak_in_flight", "peak_memory", "step",
                    "checkpoints", "stragglers", "failures")   # (session.py: saves, stragglers, restarts)
            keys += tuple(k for k in ("fp8_worst",) if k in self.summary)   # (--fp8-stats: the worst linears)
            files.write_text(os.path.join(self.tcfg.out_dir, "summary.json"),
                             files.json_text({k: self.summary.get(k) for k in keys}, indent=2))
            write_report(self.tcfg.out_dir)   # report.html, from the run's files (run/report.py)
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
                router = "" if self.router_loss is None else f" (router losses {self.router_loss:.4f} beside it)"
                self.print(f"done: {self.last_step} steps, final loss {losses[-1]:.4f}{router}"
                           + (f", val loss {vals[-1]:.4f}" if vals else "") + f"; metrics in {self.path}")
        return self.summary
