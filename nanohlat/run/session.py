"""Everything around train.py's step, behind two calls: `Session(...)` and `end_step`.

train.py's loop shows the lesson: the batch, forward and backward, the
optimizer step. What a real run needs besides, and what no step depends on,
happens here, in this order:

  * at the start (`Session(...)`): resume from a checkpoint (model, optimizer
    and its step count, RNGs; the lr and the data follow from the step), and
    open the run's record (trainlog.TrainLog: prints, progress bar, files);
  * after each step (`end_step`): what the end of a step takes, in order, a
    commented line each in its body;
  * at the end (`close`): the pipeline timeline (--timeline) and summary.json.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from nanohlat import comm, recipe
from nanohlat.config import UserError
from nanohlat.data_parallel import global_mean, split_batch
from nanohlat.run import checkpoint, preempt, replicas, trainlog
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
        # prints (rank 0), the progress bar, config.json, metrics.jsonl, summary.json, non-finite steps
        self.log = trainlog.TrainLog(model_cfg, tcfg, mesh, dev, model, opt, ds.tokenizer.path, self.start_step,
                                     bad_steps, resumed_from=resume_from)
        mesh.ledger.reset()   # from here the comm ledger counts the first step's traffic (end_step reports it)
        preempt.training_begins()   # a signal from here: finish the step, save (before it: end at once, startup.py)

    def end_step(self, step: int, loss: torch.Tensor, norm: torch.Tensor, finite: torch.Tensor, lr: float) -> bool:
        """After the optimizer step of step `step` (counted from 1). True: the run stops here."""
        tcfg, mesh, dev = self.tcfg, self.mesh, self.dev
        last = step == tcfg.steps or 0 < tcfg.stop_after <= step   # --stop-after: as if interrupted
        if self.runner.clock:
            self.runner.clock.end_step()   # --timeline: what follows is no collective of the step
        self.log.count(finite)   # runs of non-finite steps, counted on the device (part of the step)
        replicas.check(self.model, mesh, step, tcfg.check_replicas, self.opt)   # --check-replicas N: copies identical?
        dev.sync()          # the step ends: on XLA its graph compiles (once) and runs
        self.tokens_seen += self.tokens_per_step
        if step == self.start_step + 1:   # what each collective moved, beside the plan's formula
            self.log.comm(trainlog.comm_summary(mesh.ledger), self.comm_report() if self.log.main else "")
        # SIGTERM / Ctrl-C, or metrics.jsonl that could not be written: all ranks stop here, saved below
        last = last or self.vote_to_stop(step, also=self.log.write_failed is not None)
        figures = self.step_figures()   # (a MoE model's router losses and expert load in the step)
        self.log.step(step, loss, norm, lr, self.tokens_seen, last, figures)   # the host reads them in a closure
        if tcfg.eval_every and (step % tcfg.eval_every == 0 or step == tcfg.steps):
            self.log.val(step, self.evaluate_loss())
            dev.sync()   # XLA: evaluation runs as its own graph, not fused into the next step's (a third big graph)
        saving = last or (tcfg.save_every and step % tcfg.save_every == 0)
        if saving:
            dev.sync()   # XLA: the queued step closures (log, non-finite stop) run before anything is written
        if saving and not self.log.stopped:   # (stopped: the last good step is saved below instead)
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
        return last

    def vote_to_stop(self, step: int, also: bool = False) -> bool:
        """Should every rank stop after `step`? The same answer on all ranks (preempt.py says why it is a
        vote): a SIGTERM or Ctrl-C any rank received, or `also`, this rank's own reason (rank 0 could not
        write metrics.jsonl). One 4-byte all-reduce over the world a step; on XLA, where reading a device
        value stalls the host, every preempt.XLA_CHECK_EVERY steps."""
        group, dev = self.mesh.group("world"), self.dev
        if group.size == 1:
            return preempt.requested() or also
        if dev.kind == "xla" and step % preempt.XLA_CHECK_EVERY:
            return False
        flag = torch.tensor([1.0 if preempt.requested() or also else 0.0], device=dev.torch_device)
        comm.all_reduce(flag, dataclasses.replace(group, ledger=None), inplace=True)   # (not the step's traffic)
        return bool(flag.item() > 0)

    def save(self, step: int, tokens: int, bad_steps: int) -> str:
        """checkpoint.save of the model and optimizer as they are, as step `step` (every rank)."""
        self.saved = (step, checkpoint.save(self.tcfg.out_dir, step, tokens, self.model, self.opt, self.mesh,
                                            self.dev, recipe.to_dict(self.model_cfg, self.tcfg),
                                            self.ds.tokenizer.path, self.tcfg.keep_last, bad_steps=bad_steps,
                                            data_fingerprint=self.ds.fingerprint))
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
        saved = self.saved[1] if self.saved and self.saved[0] == good else \
            self.save(good, self.tokens_seen - streak * self.tokens_per_step, 0)
        raise UserError(f"{self.log.stopped}. Their updates were skipped, so the weights are those of step {good}, "
                        f"the last good one: saved in {saved}. Lower --lr or check the data; --resume auto "
                        f"continues from there")

    def step_figures(self) -> dict:
        """Figures of the step that the model's parts keep besides the loss, to log beside it: the
        model's `step_figures` (run/build.py:decoder gives a mixture of experts one), {} if none.
        Every rank takes part (they add up over the ranks). Reading them changes nothing."""
        figures = self.model.step_figures
        return figures.metrics(self.mesh, self.dev.torch_device) if figures is not None else {}

    def close(self) -> dict:
        """The end of the run: the timeline (--timeline), summary.json. Returns the summary (rank 0's view)."""
        if self.tcfg.timeline:
            self.write_timeline()
        return self.log.close(peak_in_flight=self.runner.peak_in_flight, **metrics.resident_bytes(self.opt),
                              peak_memory=metrics.peak_memory(self.dev))

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
        text = timeline.timeline_report(self.runner, self.mesh, self.tcfg, os.path.join(out_dir, "timeline.png"))
        text = "\n".join([text] + comm_trace.trace_report(self.runner.clock, self.mesh, self.runner.device))
        if self.mesh.rank == 0 and text:
            files.write_text(os.path.join(out_dir, "timeline.txt"), text + "\n")
            print(text)
