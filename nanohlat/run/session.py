"""Everything around train.py's step, behind two calls: `Session(...)` and `end_step`.

train.py's loop shows the lesson: the batch, forward and backward, the
optimizer step. What a real run needs besides, and what no step depends on,
happens here, in this order:

  * at the start (`Session(...)`): resume from a checkpoint (model, optimizer
    and its step count, RNGs; the lr and the data follow from the step), and
    open the run's record (trainlog.TrainLog: prints, progress bar, files);
  * after each step (`end_step`): what the end of a step takes, in order, a
    commented line each in its body;
  * at the end (`close`): the pipeline timeline (--timeline), summary.json
    and the run's report.html (trainlog.TrainLog.close, run/report.py).

Three watches of failures at scale live beside the step too: checkpoints
written in the background (--async-save: run/checkpoint/background.py), the
straggler watch (--straggler-every: run/stragglers.py), and what a restart
after a failure cost (run/restarts.py); and the fault lab's faults on
purpose, nothing unless NANOHLAT_FAULTS is set (run/faults.py).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch

from nanohlat import comm, recipe
from nanohlat.config import UserError
from nanohlat.data_parallel import global_mean, split_batch
from nanohlat.run import checkpoint, faults, preempt, replicas, restarts, stragglers, trainlog
from nanohlat.run.checkpoint.background import BackgroundSaver
from nanohlat.system import files
from nanohlat import plan
from nanohlat.tools import comm_trace, metrics, timeline


class Session:
    def __init__(self, model_cfg, tcfg, mesh, dev, model, runner, opt, ds, resume_from: str | None):
        self.model_cfg, self.tcfg, self.mesh, self.dev = model_cfg, tcfg, mesh, dev
        self.model, self.runner, self.opt, self.ds = model, runner, opt, ds
        self.start_step, self.tokens_seen, bad_steps = 0, 0, 0
        self.saved: tuple[int, str] | None = None   # (step, path) of the out-dir's checkpoint this run is at
        if resume_from:   # model, optimizer (+ its step count), RNGs; the lr and data follow from the step
            manifest = checkpoint.load(resume_from, model, opt, mesh, dev)
            self.start_step, self.tokens_seen = manifest["step"], manifest["tokens"]
            bad_steps = manifest.get("schedule", {}).get("bad_steps", 0)
            if os.path.dirname(os.path.abspath(resume_from)) == os.path.abspath(checkpoint.ckpt_root(tcfg.out_dir)):
                self.saved = (self.start_step, resume_from)
        self.tokens_per_step = tcfg.batch_size * tcfg.seq_len
        faults.planted()   # NANOHLAT_FAULTS, the fault lab's (run/faults.py): a malformed one stops here
        # after a launcher's restart: what the failure cost, read before TrainLog cuts metrics.jsonl back
        self.restarts = restarts.Restarts(tcfg.out_dir, self.start_step, mesh.rank == 0)
        # prints (rank 0), the progress bar, config.json, metrics.jsonl, summary.json, report.html, non-finite steps
        self.log = trainlog.TrainLog(model_cfg, tcfg, mesh, dev, model, opt, ds.tokenizer.path, self.start_step,
                                     bad_steps, resumed_from=resume_from)
        self.restarts.opened(self.log)
        self.saver = BackgroundSaver(mesh, dev, self.log.print) if tcfg.async_save else None
        self.stalls: list[float] = []   # the seconds each synchronous save stopped the steps
        self.stragglers = stragglers.Stragglers(mesh, tcfg, dev, self.log.print)
        mesh.ledger.reset()   # from here the comm ledger counts the first step's traffic (end_step reports it)
        preempt.training_begins()   # a signal from here: finish the step, save (before it: end at once, startup.py)

    def end_step(self, step: int, loss: torch.Tensor, norm: torch.Tensor, finite: torch.Tensor, lr: float) -> bool:
        """After the optimizer step of step `step` (counted from 1). True: the run stops here."""
        tcfg, mesh, dev = self.tcfg, self.mesh, self.dev
        self.stragglers.stop()   # --straggler-every: this rank's own time in the step ends here
        last = step == tcfg.steps or 0 < tcfg.stop_after <= step   # --stop-after: as if interrupted
        if self.runner.clock:
            self.runner.clock.end_step()   # --timeline: what follows is no collective of the step
        self.log.count(finite)   # runs of non-finite steps, counted on the device (part of the step)
        replicas.check(self.model, mesh, step, tcfg.check_replicas, self.opt)   # --check-replicas N: copies identical?
        dev.sync()          # the step ends: on XLA its graph compiles (once) and runs
        self.tokens_seen += self.tokens_per_step
        if step == self.start_step + 1:   # what each collective moved, beside the plan's formula
            self.log.comm(trainlog.comm_summary(mesh.ledger), self.comm_report() if self.log.main else "")
        self.stragglers.check(step)   # every --straggler-every steps: one all-gather of the ranks' own times
        # SIGTERM / Ctrl-C, or metrics.jsonl that could not be written: all ranks stop here, saved below;
        # --async-save: the same vote says whether every rank's writer is done with its shard
        stop, writing = self.vote(step, also=self.log.write_failed is not None,
                                  writing=self.saver is not None and self.saver.writing())
        last = last or stop
        if self.saver is not None and not writing:
            self.saver.finish()   # every rank's shard written: gather their checksums; rank 0 publishes
        figures = self.step_figures(step)   # (a MoE model's router losses and expert load; --fp8-stats)
        self.log.step(step, loss, norm, lr, self.tokens_seen, last, figures)   # the host reads them in a closure
        faults.at_step_end(step, mesh.rank)   # the fault lab's kill -9 or hang of this rank (unset: nothing)
        if tcfg.eval_every and (step % tcfg.eval_every == 0 or step == tcfg.steps):
            self.log.val(step, self.evaluate_loss())
            dev.sync()   # XLA: evaluation runs as its own graph, not fused into the next step's (a third big graph)
        saving = last or (tcfg.save_every and step % tcfg.save_every == 0)
        if saving:
            dev.sync()   # XLA: the queued step closures (log, non-finite stop) run before anything is written
        if saving and not self.log.stopped and self.saver is not None and not last:
            self.saver.save(tcfg.out_dir, step, **self.save_args(self.tokens_seen, self.log.bad_steps()))
        elif saving and not self.log.stopped:   # (stopped: the last good step is saved below instead)
            try:
                saved = self.save(step, self.tokens_seen, self.log.bad_steps())
            except UserError as e:
                if self.log.write_failed is None:
                    raise
                raise UserError(f"{self.log.write_failed}; the run stopped at step {step} and could not save "
                                f"it either ({e})") from None
            if last and self.log.write_failed is not None:   # rank 0: what failed, and that nothing was lost
                raise UserError(f"{self.log.write_failed}; the run stopped at step {step} and saved what it "
                                f"trained in {saved}: free some space, then --resume auto continues from it")
        if self.log.stopped:   # --max-bad-steps: the last good step is saved first (every rank), then the line
            self.stop_itself(step)
        self.restarts.at(step)   # after a restart: back at the failed attempt's last step, what it cost
        self.stragglers.start(step + 1)   # (--straggler-every: the next step's own time, from here)
        faults.before_step(step + 1, mesh.rank)   # the fault lab's slow rank (unset: nothing)
        return last

    def vote(self, step: int, also: bool = False, writing: bool = False) -> tuple[bool, bool]:
        """(stop, writing): should every rank stop after `step`, and is any rank's --async-save writer still
        writing? The same answers on all ranks (preempt.py says why it is a vote): a SIGTERM or Ctrl-C any
        rank received, or `also`, this rank's own reason (rank 0 could not write metrics.jsonl); `writing`,
        this rank's writer. One all-reduce of 2 numbers over the world a step; on XLA, where reading a device
        value stalls the host, every preempt.XLA_CHECK_EVERY steps (between them: no stop, still writing)."""
        group, dev = self.mesh.group("world"), self.dev
        if group.size == 1:
            return preempt.requested() or also, writing
        if dev.kind == "xla" and step % preempt.XLA_CHECK_EVERY:
            return False, self.saver is not None and self.saver.pending is not None
        flag = torch.tensor([1.0 if preempt.requested() or also else 0.0, float(writing)], device=dev.torch_device)
        comm.all_reduce(flag, dataclasses.replace(group, ledger=None), inplace=True)   # (not the step's traffic)
        stop, busy = flag.tolist()
        return stop > 0, busy > 0

    def vote_to_stop(self, step: int, also: bool = False) -> bool:
        """vote's first answer: should every rank stop after `step`?"""
        return self.vote(step, also)[0]

    def save_args(self, tokens: int, bad_steps: int) -> dict:
        """checkpoint.save's arguments after the step but the out-dir, the step and the device (saving.snapshot's)."""
        return dict(tokens=tokens, model=self.model, opt=self.opt, mesh=self.mesh,
                    config=recipe.to_dict(self.model_cfg, self.tcfg), tokenizer_path=self.ds.tokenizer.path,
                    keep_last=self.tcfg.keep_last, bad_steps=bad_steps, data_fingerprint=self.ds.fingerprint)

    def save(self, step: int, tokens: int, bad_steps: int) -> str:
        """checkpoint.save of the model and optimizer as they are, as step `step` (every rank); with
        --async-save the save in flight is finished first (drained: gathered and published)."""
        if self.saver is not None:
            self.saved = self.saver.drain() or self.saved
            if self.saved and self.saved[0] == step:
                return self.saved[1]
        t0 = time.perf_counter()
        self.saved = (step, checkpoint.save(self.tcfg.out_dir, step, device=self.dev,
                                            **self.save_args(tokens, bad_steps)))
        self.stalls.append(time.perf_counter() - t0)
        return self.saved[1]

    def stop_itself(self, step: int) -> None:
        """The run stops itself (--max-bad-steps, trainlog.TrainLog.stopped) after step `step`. The
        updates of its last `streak` steps were skipped (optim.FlatAdamW.update multiplies them by
        0), so the weights, Adam's moments and step count in memory are those of step - streak, the
        last good step: saved as that step's checkpoint (its tokens, 0 bad steps; unless this run is
        at it already), which `--resume auto` continues from as from any checkpoint of that step
        (the data and the lr follow from the step, no step draws from the RNGs). Then one line."""
        streak = self.log.bad_steps()
        good = step - streak
        if self.saver is not None:   # (--async-save: the save in flight, maybe of that very step, finished)
            self.saved = self.saver.drain() or self.saved
        saved = self.saved[1] if self.saved and self.saved[0] == good else \
            self.save(good, self.tokens_seen - streak * self.tokens_per_step, 0)
        raise UserError(f"{self.log.stopped}. Their updates were skipped, so the weights are those of step {good}, "
                        f"the last good one: saved in {saved}. Lower --lr or check the data; --resume auto "
                        f"continues from there")

    def step_figures(self, step: int) -> dict:
        """Figures of step `step` that the model's parts keep besides the loss, to log beside it: the
        model's `step_figures` (run/build.py gives a mixture of experts one, --fp8-stats another), {} if
        none. Every rank takes part (they add up over the ranks). Reading them changes nothing."""
        figures = self.model.step_figures
        return figures.metrics(self.mesh, self.dev.torch_device, step) if figures is not None else {}

    def close(self) -> dict:
        """The end of the run: the timeline (--timeline), summary.json, report.html. Returns the summary
        (rank 0's view)."""
        if self.tcfg.timeline:
            self.write_timeline()
        self.failures_summary()
        # what the model's parts say of the whole run (--fp8-stats: its worst linears), for summary.json and a line
        said, line = self.model.step_figures.closing() if self.model.step_figures is not None else ({}, "")
        if line:
            self.log.print(line)
        return self.log.close(peak_in_flight=self.runner.peak_in_flight, **metrics.resident_bytes(self.opt),
                              peak_memory=metrics.peak_memory(self.dev), **said)

    def failures_summary(self) -> None:
        """summary.json's "checkpoints" (each save's stall: the seconds it stopped the steps), "stragglers"
        and "failures" (restarts), and a line for each that has something to say (rank 0)."""
        saves = {"sync_stall_s": self.stalls}
        if self.saver is not None:
            saves.update(self.saver.summary())
            line = background_line(saves)
            if line:
                self.log.print(line)
        self.log.summary["checkpoints"] = saves
        self.log.summary["stragglers"] = self.stragglers.found
        if self.mesh.rank == 0:
            self.log.summary["failures"] = failures = self.restarts.summary()
            for line in (self.stragglers.summary_line(), restarts.Restarts.line(failures)):
                if line:
                    self.log.print(line)

    @torch.no_grad()
    def evaluate_loss(self) -> torch.Tensor:
        """Mean held-out loss over --eval-batches fixed validation batches (same in every layout)."""
        tcfg, mesh, dev = self.tcfg, self.mesh, self.dev
        total = torch.zeros((), device=dev.torch_device)
        for i in range(tcfg.eval_batches):
            tokens, targets = split_batch(self.ds.batch(i, tcfg.batch_size, tcfg.seq_len, tcfg.seed, split="val"),
                                          mesh, tcfg, dev)
            total = total + self.runner.forward_only(tokens, targets, 1.0 / self.tokens_per_step)
        return global_mean(total, mesh) / tcfg.eval_batches

    def comm_report(self) -> str:
        """The comm ledger of the first step on this rank, beside the plan's (plan/sheets.py:comm_report)."""
        return plan.comm_report(self.model_cfg, self.tcfg, self.mesh, self.mesh.ledger.snapshot())

    def write_timeline(self) -> None:
        out_dir = self.tcfg.out_dir
        # the pipeline's timeline (a gather over pp), then the step's collectives seen by the traces (over cp)
        text = timeline.timeline_report(self.runner, self.mesh, self.tcfg, os.path.join(out_dir, "timeline.png"),
                                        os.path.join(out_dir, "timeline.json"))
        text = "\n".join([text] + comm_trace.trace_report(self.runner.clock, self.mesh, self.runner.device))
        if self.mesh.rank == 0 and text:
            files.write_text(os.path.join(out_dir, "timeline.txt"), text + "\n")
            print(text)


def background_line(saves: dict) -> str:
    """--async-save's line at the run's end: how long its saves stopped the steps, against the writes."""
    n = saves["async_saves"]
    if not n:
        return ""
    ms = lambda xs: f"{statistics.median(xs) * 1e3:.1f} ms" if xs else "-"   # noqa: E731
    waited = saves["waited_s"]
    return (f"checkpoints: {n} saved in the background (--async-save): each stopped the steps for "
            f"{ms(saves['stall_s'])} (median), its shard written in {ms(saves['write_s'])} beside them"
            + (f"; {len(waited)} waited for the one before, {sum(waited):.2f} s in all" if waited else "")
            + (f"; {saves['failed']} failed (said above)" if saves["failed"] else "")
            + (f"; the last step's, saved at the end: {ms(saves['sync_stall_s'])}" if saves["sync_stall_s"] else ""))
