"""Pre-train a HLAT-style LLaMA model: one process, N local workers, or torchrun.

    python train.py                                   # default preset on the built-in corpus
    python train.py --preset tiny --nproc 8 --tp 2 --pp 2 --dp 2 --zero1 --sequence-parallel
    torchrun --nproc_per_node 2 train.py --tp 2

The whole flow is `train()` below, in order: config -> mesh -> data -> model,
schedule and optimizer (`build.build`) -> checkpoint -> the loop. Each step is
one call into a module of nanohlat/ whose name says what it does; what the run
prints and writes is `metrics.TrainLog`, beside the loop rather than in it.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed

from nanohlat.run import checkpoint, data, launch, metrics, preempt, replicas, runlock
from nanohlat import comm, config, optim
from nanohlat.tools import timeline
from nanohlat import device as devicelib
from nanohlat import mesh as meshlib
from nanohlat.run.build import build
from nanohlat.config import UserError
from nanohlat.run.files import os_error_message


def train(model_cfg: config.ModelConfig, tcfg: config.TrainConfig, rank: int = 0, world: int = 1,
          local_rank: int = 0, local_world: int = 1) -> dict:
    """Run (or resume) training on this rank. Returns a summary (rank 0's view)."""
    # What to resume from is decided before the process group exists: until
    # every rank has joined it no rank writes into out-dir, so all see the same files.
    resume_from = checkpoint.find_resume(tcfg.out_dir, tcfg.resume, tcfg.overwrite, launch.restart_count() > 0)

    # -- device and mesh ---------------------------------------------------
    dev = devicelib.get_device(tcfg.device, local_rank, tcfg.precision)   # precision: trn1's rounding mode
    dev.manual_seed(tcfg.seed)   # torch's generators and, on xla, the device's own (a resume restores them)
    if dev.kind == "cpu":
        devicelib.set_cpu_threads(tcfg.threads or max(1, (os.cpu_count() or 1) // local_world))
    if world > 1 and not torch.distributed.is_initialized():
        with launch.rendezvous_deadline(tcfg.rendezvous_timeout, rank, world, on_timeout=runlock.release_all):
            dev.init_process_group(rank, world)
    dp = meshlib.validate_layout(model_cfg, tcfg, world)
    mesh = meshlib.Mesh(tcfg.tp, tcfg.pp, dp, rank, ledger=comm.CommLedger(),
                        kv_replicas=meshlib.kv_replicas(model_cfg, tcfg.tp))
    mesh.build_groups(dev if world > 1 else None)

    # -- data: the global batch of step k depends only on (seed, k) ----------
    # (main() built the cache and said so; here the workers only open it)
    ds = data.prepare_data(tcfg.data, tcfg.tokenizer, model_cfg.vocab_size, tcfg.cache_dir, log=lambda *a: None)

    # -- model (this rank's stage and tensor slice), schedule, optimizer -----
    model, runner, opt = build(model_cfg, tcfg, mesh, dev)

    # -- checkpoint: resume where the last complete checkpoint left off --------
    start_step, tokens_seen, bad_steps = 0, 0, 0
    if resume_from:   # model, optimizer (+ its step count), RNGs; the lr and data follow from the step
        manifest = checkpoint.load(resume_from, model, opt, mesh, dev)
        start_step, tokens_seen = manifest["step"], manifest["tokens"]
        bad_steps = manifest.get("schedule", {}).get("bad_steps", 0)
    # prints (rank 0), the progress bar, config.json, metrics.jsonl, summary.json, non-finite steps
    log = metrics.TrainLog(model_cfg, tcfg, mesh, dev, model, opt, ds.tokenizer.path, start_step, bad_steps,
                           resumed_from=resume_from)

    # -- the loop ------------------------------------------------------------
    tokens_per_step = tcfg.batch_size * tcfg.seq_len
    for step in range(start_step, tcfg.steps):
        last = step + 1 == tcfg.steps or 0 < tcfg.stop_after <= step + 1   # --stop-after: as if interrupted
        lr = optim.cosine_lr(step, tcfg.lr, tcfg.min_lr, tcfg.warmup_steps, tcfg.steps)
        tokens, targets = split_batch(ds.batch(step, tcfg.batch_size, tcfg.seq_len, tcfg.seed), mesh, tcfg, dev)
        mesh.ledger.reset()
        opt.zero_grad()
        loss = global_mean(runner.run(tokens, targets, 1.0 / tokens_per_step), mesh)   # forward + backward
        # the optimizer step (optim.py), phase by phase. The gradients are already in its flat fp32
        # buffers: its hooks moved each p.grad there as autograd made it (optim.py:FlatGroup.accumulate_hook)
        grads = opt.reduce_gradients()                  # DP: all-reduce; ZeRO-1: reduce-scatter
        norm = opt.global_grad_norm(grads)              # one number: all-reduces of 4 bytes over tp, pp (ZeRO-1: dp)
        finite = torch.isfinite(norm) & torch.isfinite(loss)   # a non-finite step updates nothing
        opt.update(grads, lr, norm, finite)             # clip + AdamW on the master (ZeRO-1: its shard)
        opt.write_back()                                # ZeRO-1: all-gather; then into the model's parameters
        log.count(finite)   # runs of non-finite steps, counted on the device (part of the step)
        replicas.check(model, mesh, step + 1, tcfg.check_replicas)     # --check-replicas N: copies still identical?
        dev.sync()          # the step ends: on XLA its graph compiles (once) and runs
        tokens_seen += tokens_per_step
        if step == start_step:   # what each collective moved, beside the plan's formula
            log.comm(mesh.ledger.summary(), comm_report(mesh, model_cfg, tcfg) if log.main else "")
        last = last or preempt.stop_requested(mesh, dev, step + 1)   # SIGTERM / Ctrl-C: all ranks stop here, saved below
        log.step(step + 1, loss, norm, lr, tokens_seen, last)   # the host reads values in a step closure
        if tcfg.eval_every and ((step + 1) % tcfg.eval_every == 0 or step + 1 == tcfg.steps):
            log.val(step + 1, evaluate_loss(runner, ds, mesh, tcfg, dev))
            dev.sync()   # XLA: evaluation runs as its own graph, not fused into the next step's (a third big graph)
        if last or (tcfg.save_every and (step + 1) % tcfg.save_every == 0):
            dev.sync()   # XLA: the queued step closures (log, non-finite stop) run before anything is written
            checkpoint.save(tcfg.out_dir, step + 1, tokens_seen, model, opt, mesh, dev,
                            config.to_dict(model_cfg, tcfg), ds.tokenizer.path, tcfg.keep_last,
                            bad_steps=log.bad_steps(), data_fingerprint=ds.fingerprint)
        if last:
            break
    if tcfg.timeline:
        write_timeline(runner, mesh, tcfg)
    return log.close(peak_in_flight=runner.peak_in_flight, optimizer_bytes=opt.state_bytes(),
                     peak_memory=metrics.peak_memory(dev))


def global_mean(x: torch.Tensor, mesh) -> torch.Tensor:
    """This rank's share of a mean -> the mean over the whole global batch, on every rank.

    `x` is already divided by the global token count, and only the last
    pipeline stage holds a loss (the others hold 0), so summing over the
    pipeline group and then over the data-parallel group gives the global mean.
    The tensor-parallel ranks of a stage already agree on it (vocab-parallel
    cross-entropy), so no sum over tp."""
    return comm.all_reduce(comm.all_reduce(x, mesh.pp_group), mesh.dp_group)


def split_batch(batch: torch.Tensor, mesh, tcfg, dev) -> tuple[list, list]:
    """Global batch (B, T+1), on the host -> this dp rank's M micro-batches:
    lists of M token and M target tensors (mb, T), each sent to the device on
    its own (on XLA a micro-batch is then a graph input, not a slice of one)."""
    per_rank = tcfg.batch_size // mesh.dp
    mine = batch[mesh.dp_rank * per_rank:(mesh.dp_rank + 1) * per_rank]
    mine = mine.view(tcfg.microbatches, per_rank // tcfg.microbatches, tcfg.seq_len + 1)
    tokens = [mb[:, :-1].contiguous().to(dev.torch_device) for mb in mine]
    targets = [mb[:, 1:].contiguous().to(dev.torch_device) for mb in mine]
    return tokens, targets


@torch.no_grad()
def evaluate_loss(runner, ds, mesh, tcfg, dev) -> torch.Tensor:
    """Mean held-out loss over --eval-batches fixed validation batches (same in every layout)."""
    total = torch.zeros((), device=dev.torch_device)
    for i in range(tcfg.eval_batches):
        tokens, targets = split_batch(ds.batch(i, tcfg.batch_size, tcfg.seq_len, tcfg.seed, split="val"),
                                      mesh, tcfg, dev)
        total = total + runner.forward_only(tokens, targets, 1.0 / (tcfg.batch_size * tcfg.seq_len))
    return global_mean(total, mesh) / tcfg.eval_batches


def comm_report(mesh, model_cfg, tcfg) -> str:
    """The comm ledger of the first step on this rank, beside the model-shape formula."""
    from nanohlat.tools import plan
    measured = mesh.ledger.snapshot()
    if not measured:
        return "communication: none (one process)"
    predicted = plan.comm_per_step(model_cfg, tcfg, mesh)
    lines = [f"communication per step on rank {mesh.rank}: the comm ledger, and plan.py's prediction"]
    return "\n".join(lines + plan.comm_table(measured, predicted) + [plan.COMM_LEGEND_SHORT])


def write_timeline(runner, mesh, tcfg) -> None:
    text = timeline.timeline_report(runner, mesh, tcfg, os.path.join(tcfg.out_dir, "timeline.png"))
    if mesh.rank == 0 and text:
        path = os.path.join(tcfg.out_dir, "timeline.txt")
        with open(path, "w") as f:
            f.write(text + "\n")
        print(text)


# ---------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------

def worker(argv: list[str]) -> dict:
    """What each launched process runs (train.py --nproc N or torchrun)."""
    rank, world, local_rank = launch.torchrun_env()
    model_cfg, tcfg = config.parse_args(argv)
    try:
        with preempt.catch_signals() as signals:   # SIGTERM / first Ctrl-C: finish the step, save, exit 143 / 130
            summary = train(model_cfg, tcfg, rank, world, local_rank, launch.local_world_size())
    except UserError as e:
        launch.report_error(str(e))
        sys.exit(2)
    except OSError as e:
        launch.report_error(os_error_message(e))
        sys.exit(2)
    except KeyboardInterrupt:   # the second Ctrl-C
        sys.exit(130)
    # Leave the job cleanly: a process group still alive at interpreter exit can abort
    # it (gloo: "terminate called without an active exception", SIGABRT, ~1 run in 5)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if signals.exit_code:
        sys.exit(signals.exit_code)
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    lock = None
    try:
        model_cfg, tcfg = config.parse_args(argv)
        env = launch.torchrun_env()
        world = env[1] if env else tcfg.nproc
        if tcfg.plan:
            from nanohlat.tools import plan
            print(plan.search_report(model_cfg, tcfg, world) if tcfg.search else plan.report(model_cfg, tcfg, world))
            return 0
        meshlib.validate_layout(model_cfg, tcfg, world)   # a bad layout fails before any tokenizer work
        devicelib.check_available(tcfg.device, tcfg.nproc if not env else 1)   # and a missing device
        # tokenizer and token shards are built once, here, before any worker starts
        ds = data.prepare_data(tcfg.data, tcfg.tokenizer, model_cfg.vocab_size, tcfg.cache_dir)
        if ds.tokenizer.vocab_size != model_cfg.vocab_size:
            argv = argv + ["--vocab-size", str(ds.tokenizer.vocab_size)]
            model_cfg, tcfg = config.parse_args(argv)
            meshlib.validate_layout(model_cfg, tcfg, world)   # the tokenizer's vocabulary must split too
        if not env or env[0] == 0:   # one run per out-dir (nanohlat/run/runlock.py), held until we return
            lock = runlock.acquire(tcfg.out_dir)
        # --resume / --out-dir problems are refused here, once, as one line, not in N workers
        restarted = launch.restart_count() > 0
        resume_from = checkpoint.find_resume(tcfg.out_dir, tcfg.resume, tcfg.overwrite, restarted)
        checkpoint.warn_incomplete(tcfg.out_dir)
        if resume_from:
            # manifest, files, model shape; before local workers start, the checksums too
            checkpoint.check(resume_from, model_cfg, checksums=not env and (tcfg.nproc > 1 or tcfg.max_restarts > 0))
            checkpoint.check_identity(resume_from, ds.tokenizer.path, ds.fingerprint, tcfg.allow_tokenizer_change)
        elif tcfg.resume == "never" and tcfg.overwrite and not restarted and (not env or env[0] == 0):
            checkpoint.clear_run(tcfg.out_dir)          # before any worker writes; under torchrun rank 0 only
        if env:
            warning = launch.torchrun_restart_warning()
            if warning and env[0] == 0 and not restarted:
                print(warning, file=sys.stderr)
            worker(argv)
            return 0
        if tcfg.nproc == 1 and not tcfg.max_restarts:   # with restarts, a launcher process supervises
            with preempt.catch_signals() as signals:
                train(model_cfg, tcfg)
            return signals.exit_code   # 0, or 143 / 130 after a SIGTERM / Ctrl-C (checkpoint saved)
        return launch.spawn(worker, (argv,), tcfg.nproc, tcfg.max_restarts)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {os_error_message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if lock:
            lock.release()


if __name__ == "__main__":
    sys.exit(main())
