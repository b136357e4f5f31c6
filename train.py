"""Pre-train a HLAT-style LLaMA model: one process, N local workers, or torchrun.

    python train.py                                   # default preset on the built-in corpus
    python train.py --preset tiny --nproc 8 --tp 2 --pp 2 --dp 2 --zero1 --sequence-parallel
    torchrun --nproc_per_node 2 train.py --tp 2

The whole flow is `train()` below, in order: config -> mesh -> data -> model
-> schedule -> optimizer -> checkpoint -> the loop. Each step is one call into
a module of nanohlat/ whose name says what it does.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed

from nanohlat import checkpoint, comm, config, data, launch, metrics, optim, pipeline
from nanohlat import device as devicelib
from nanohlat import mesh as meshlib
from nanohlat.config import UserError
from nanohlat.model import Transformer, init_weights
from nanohlat.precision import param_dtype


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
        dev.init_process_group(rank, world)
    dp = meshlib.validate_layout(model_cfg, tcfg, world)
    mesh = meshlib.Mesh(tcfg.tp, tcfg.pp, dp, rank, ledger=comm.CommLedger(),
                        kv_replicas=meshlib.kv_replicas(model_cfg, tcfg.tp))
    mesh.build_groups(dev if world > 1 else None)
    main = rank == 0
    log = print if main else (lambda *a, **k: None)

    # -- data: the global batch of step k depends only on (seed, k) ----------
    # (main() built the cache and said so; here the workers only open it)
    ds = data.prepare_data(tcfg.data, tcfg.tokenizer, model_cfg.vocab_size, tcfg.cache_dir, log=lambda *a: None)

    # -- model: this rank's stage and tensor slice, initialised layout-independently
    layers = pipeline.stage_layers(model_cfg.n_layers, mesh.pp, mesh.pp_rank)
    model = Transformer(model_cfg, mesh.tp_group, tcfg.sequence_parallel, layers,
                        first=mesh.is_first_stage, last=mesh.is_last_stage, kv_group=mesh.group("kv"))
    init_weights(model, tcfg.seed)
    dtype = param_dtype(tcfg.precision)
    dev.place(model, dtype)   # = model.to(device, dtype), keeping the parameters' sharding attributes
    model.set_activation_checkpointing(tcfg.activation_checkpointing, dev.checkpoint)

    # -- schedule and optimizer ---------------------------------------------
    mb = tcfg.batch_size // (dp * tcfg.microbatches)
    seq_local = tcfg.seq_len // mesh.tp if model.sequence_parallel else tcfg.seq_len
    runner = pipeline.PipelineRunner(model, mesh, tcfg, (mb, seq_local, model_cfg.d_model), dtype, dev)
    opt = optim.FlatAdamW(model, mesh, tcfg, dev)

    # -- checkpoint: resume where the last complete checkpoint left off --------
    start_step, tokens_seen, bad_steps = 0, 0, 0
    if resume_from:   # model, optimizer (+ its step count), RNGs; the lr and data follow from the step
        manifest = checkpoint.load(resume_from, model, opt, mesh, dev)
        start_step, tokens_seen = manifest["step"], manifest["tokens"]
        bad_steps = manifest.get("schedule", {}).get("bad_steps", 0)
        log(f"resumed from {resume_from} at step {start_step}")
    if main:
        os.makedirs(tcfg.out_dir, exist_ok=True)
        run_cfg = config.to_dict(model_cfg, tcfg) | {"world": world, "dp": dp, "tokenizer_path": ds.tokenizer.path}
        with open(os.path.join(tcfg.out_dir, "config.json"), "w") as f:
            json.dump(run_cfg, f, indent=2)
        checkpoint.truncate_metrics(os.path.join(tcfg.out_dir, "metrics.jsonl"), start_step)
        log(meshlib.layout_table(mesh.tp, mesh.pp, mesh.dp, model_cfg.n_layers, max_rows=16))
        log(f"model: {model_cfg.num_params() / 1e6:.2f}M parameters; this rank: "
            f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M; optimizer state on this rank: "
            f"{opt.state_bytes() / 2**20:.1f} MiB ({'ZeRO-1' if tcfg.zero1 else 'replicated'})")
    writer = metrics.MetricsWriter(os.path.join(tcfg.out_dir, "metrics.jsonl")) if main else None

    # -- the loop ------------------------------------------------------------
    tokens_per_step = tcfg.batch_size * tcfg.seq_len
    flops_tok = metrics.flops_per_token(model_cfg, tcfg.seq_len)
    # CPUs: the matmul rate measured right now on this process's threads (metrics.measure_cpu_peak)
    peak = metrics.measure_cpu_peak() if dev.kind == "cpu" else metrics.peak_flops(dev.name, tcfg.precision)
    peak_total = peak * world if peak else None
    meter = metrics.Throughput()
    # Non-finite steps, counted on the device (no host sync per step): the
    # current run of them, the longest run and how many in all. The host looks
    # at them when a step is logged (log_step, below). They are never reset in
    # the loop: a reset after a logged step would feed that step's successor
    # constants where the others get device data, i.e. a second step graph to
    # compile on XLA (with --log-every > 1, and after every checkpoint).
    bad_streak = torch.full((), float(bad_steps), device=dev.torch_device)
    worst_streak, skipped = bad_streak.clone(), torch.zeros((), device=dev.torch_device)
    skipped_logged = [0]   # `skipped` at the previous log (host side)
    saved_step = start_step if resume_from else -1     # the newest checkpoint of this run holds this step
    bar = None
    if main and tcfg.progress:
        from tqdm import tqdm
        bar = tqdm(total=tcfg.steps, initial=start_step, desc="train", dynamic_ncols=True)
    summary = {"losses": [], "val_losses": []}
    last_step = start_step

    def log_step(step, loss, norm, worst, skipped, lr, tokens):
        """Runs once the step's values exist (a step closure on XLA: no host sync in the step)."""
        loss, norm = float(loss), float(norm)
        # neuron_parallel_compile runs the script on zeros, not values: nothing to judge then
        judge = not devicelib.extract_graphs_only()
        worst, skipped_total = (int(worst), int(skipped)) if judge else (0, 0)
        skipped, skipped_logged[0] = skipped_total - skipped_logged[0], skipped_total   # since the last log
        if skipped and main:   # the optimizer already skipped their updates (torch.where in optim.step)
            what = (f"step {step} had" if tcfg.log_every == 1 else
                    f"{skipped} step(s) since the last log (up to step {step}) had")
            print(f"warning: {what} a non-finite loss or gradient; the update was skipped", file=sys.stderr)
        tps = meter.update(tokens_per_step)
        mfu = metrics.mfu(tps, flops_tok, peak_total)
        summary["losses"].append(loss)
        if writer:
            writer.write({"step": step, "loss": loss, "lr": lr, "grad_norm": norm, "tokens": tokens,
                          "tokens_per_s": tps, "mfu": mfu})
        if bar:
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tps:,.0f}", mfu=f"{(mfu or 0) * 100:.1f}%")
        if 0 < tcfg.max_bad_steps <= worst:   # (0: never stop) every rank sees the same counts: all stop together
            raise UserError(f"{worst} steps in a row had a non-finite loss or gradient (by step {step}); "
                            f"stopping at --max-bad-steps {tcfg.max_bad_steps}. Lower --lr or check the "
                            f"data, then resume from a checkpoint saved before the trouble (--resume PATH)")

    for step in range(start_step, tcfg.steps):
        lr = optim.cosine_lr(step, tcfg.lr, tcfg.min_lr, tcfg.warmup_steps, tcfg.steps)
        tokens, targets = split_batch(ds.batch(step, tcfg.batch_size, tcfg.seq_len, tcfg.seed), mesh, tcfg, dev)
        mesh.ledger.reset()
        opt.zero_grad()
        loss = runner.run(tokens, targets, 1.0 / tokens_per_step)
        loss = comm.all_reduce(comm.all_reduce(loss, mesh.pp_group), mesh.dp_group)   # global mean
        norm, finite = opt.step(lr, loss_finite=torch.isfinite(loss))   # a non-finite step updates nothing
        bad_streak = torch.where(finite, torch.zeros_like(bad_streak), bad_streak + 1)
        worst_streak = torch.maximum(worst_streak, bad_streak)
        skipped = skipped + (bad_streak > 0).float()
        dev.sync()
        tokens_seen += tokens_per_step
        if step == start_step:
            summary["comm_bytes"] = mesh.ledger.snapshot()
            if main:
                log(comm_report(mesh, model_cfg, tcfg))
        if (step + 1) % tcfg.log_every == 0 or step + 1 in (tcfg.steps, tcfg.stop_after):
            dev.add_step_closure(log_step, step + 1, loss, norm, worst_streak, skipped, lr, tokens_seen)
        if tcfg.eval_every and ((step + 1) % tcfg.eval_every == 0 or step + 1 == tcfg.steps):
            val = evaluate_loss(runner, ds, mesh, tcfg, dev)
            dev.add_step_closure(lambda s, v: (summary["val_losses"].append(float(v)),
                                               writer and writer.write({"step": s, "val_loss": float(v)})),
                                 step + 1, val)
            dev.sync()   # XLA: evaluation runs as its own graph, not fused into the next step's (a third big graph)
        if bar:
            bar.update(1)
        last_step = step + 1
        if tcfg.save_every and last_step % tcfg.save_every == 0 and last_step < tcfg.steps:
            checkpoint.save(tcfg.out_dir, last_step, tokens_seen, model, opt, mesh, dev,
                            config.to_dict(model_cfg, tcfg), ds.tokenizer.path, tcfg.keep_last,
                            bad_steps=int(bad_streak))
            saved_step = last_step
        if tcfg.stop_after and last_step >= tcfg.stop_after:
            break
    dev.sync()
    if bar:
        bar.close()
    if last_step != saved_step:   # the final (or --stop-after) state, unless just saved
        checkpoint.save(tcfg.out_dir, last_step, tokens_seen, model, opt, mesh, dev,
                        config.to_dict(model_cfg, tcfg), ds.tokenizer.path, tcfg.keep_last,
                        bad_steps=int(bad_streak))
    if tcfg.timeline:
        write_timeline(runner, mesh, tcfg)
    summary.update(peak_in_flight=runner.peak_in_flight, optimizer_bytes=opt.state_bytes(),
                   peak_memory=dev.peak_memory(), step=last_step)
    if main:   # what the plan predicted, as measured on rank 0 (tests compare the two)
        keys = ("comm_bytes", "optimizer_bytes", "peak_in_flight", "peak_memory", "step")
        with open(os.path.join(tcfg.out_dir, "summary.json"), "w") as f:
            json.dump({k: summary.get(k) for k in keys}, f, indent=2)
    if writer:
        writer.close()
        log(f"done: {last_step} steps, final loss {summary['losses'][-1] if summary['losses'] else float('nan'):.4f}"
            + (f", val loss {summary['val_losses'][-1]:.4f}" if summary["val_losses"] else "")
            + f"; metrics in {os.path.join(tcfg.out_dir, 'metrics.jsonl')}")
    return summary


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
    total = comm.all_reduce(comm.all_reduce(total, mesh.pp_group), mesh.dp_group)
    return total / tcfg.eval_batches


def comm_report(mesh, model_cfg, tcfg) -> str:
    """The comm ledger of the first step on this rank, beside the model-shape formula."""
    from nanohlat import plan
    measured = mesh.ledger.snapshot()
    predicted = plan.comm_bytes_per_step(model_cfg, tcfg, mesh)
    keys = sorted(set(measured) | set(predicted))
    if not keys:
        return "communication: none (one process)"
    lines = ["communication per step on rank 0 (bytes): collective  measured  predicted"]
    for k in keys:
        lines.append(f"  {k:<24} {measured.get(k, 0):>14,} {predicted.get(k, 0):>14,}")
    return "\n".join(lines)


def write_timeline(runner, mesh, tcfg) -> None:
    text = pipeline.timeline_report(runner, mesh, tcfg, os.path.join(tcfg.out_dir, "timeline.png"))
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
        summary = train(model_cfg, tcfg, rank, world, local_rank, launch.local_world_size())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    # Leave the job cleanly: a process group still alive at interpreter exit can abort
    # it (gloo: "terminate called without an active exception", SIGABRT, ~1 run in 5)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        model_cfg, tcfg = config.parse_args(argv)
        env = launch.torchrun_env()
        world = env[1] if env else tcfg.nproc
        if tcfg.plan:
            from nanohlat import plan
            print(plan.report(model_cfg, tcfg, world))
            return 0
        meshlib.validate_layout(model_cfg, tcfg, world)   # a bad layout fails before any tokenizer work
        # tokenizer and token shards are built once, here, before any worker starts
        ds = data.prepare_data(tcfg.data, tcfg.tokenizer, model_cfg.vocab_size, tcfg.cache_dir)
        if ds.tokenizer.vocab_size != model_cfg.vocab_size:
            argv = argv + ["--vocab-size", str(ds.tokenizer.vocab_size)]
            model_cfg, tcfg = config.parse_args(argv)
            meshlib.validate_layout(model_cfg, tcfg, world)   # the tokenizer's vocabulary must split too
        # --resume / --out-dir problems are refused here, once, as one line, not in N workers
        restarted = launch.restart_count() > 0
        resume_from = checkpoint.find_resume(tcfg.out_dir, tcfg.resume, tcfg.overwrite, restarted)
        if resume_from:
            # manifest, files, model shape; before local workers start, the checksums too
            checkpoint.check(resume_from, model_cfg, checksums=not env and (tcfg.nproc > 1 or tcfg.max_restarts > 0))
        elif tcfg.resume == "never" and tcfg.overwrite and not restarted and (not env or env[0] == 0):
            checkpoint.clear_run(tcfg.out_dir)          # before any worker writes; under torchrun rank 0 only
        if env:
            warning = launch.torchrun_restart_warning()
            if warning and env[0] == 0 and not restarted:
                print(warning, file=sys.stderr)
            worker(argv)
            return 0
        if tcfg.nproc == 1 and not tcfg.max_restarts:   # with restarts, a launcher process supervises
            train(model_cfg, tcfg)
            return 0
        return launch.spawn(worker, (argv,), tcfg.nproc, tcfg.max_restarts)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
