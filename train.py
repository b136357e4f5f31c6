"""Pre-train a HLAT-style LLaMA model: one process, N local workers, or torchrun.

    python train.py                                   # default preset on the built-in corpus
    python train.py --preset tiny --nproc 8 --tp 2 --pp 2 --dp 2 --zero1 --sequence-parallel
    torchrun --nproc_per_node 2 train.py --tp 2

A step is one optimizer update from one global batch: this rank's share of the
batch (`data_parallel.split_batch`), forward and backward through this rank's
pipeline stage and tensor slice (`pipeline.PipelineRunner.run`), the loss of
the whole batch (`data_parallel.global_mean`), then the optimizer's four phases
(`optim.FlatAdamW`; on the CPU and with --compile its subclass
`tools/fast_adamw.py:FastFlatAdamW`, its numbers sooner: torch's fused AdamW
kernel on the CPU, within a bound its test derives). `train()` below
builds what a step needs on the device it is given (the mesh, and
`run/build.py:build` for the model, schedule and optimizer) and runs the
steps. The rest lives elsewhere:
  * before `train()`, pre-flight, once (nanohlat/run/preflight.py, which
    `main()` calls): flags, checks, data, what to resume from, the workers;
    and in each worker, its place in the job (`preflight.join`: its device,
    cpu, cuda or xla (device.py), its seeds and threads, the process group);
  * around the steps, nanohlat/run/session.py: `Session(...)` resumes and
    opens the log; `end_step` ends each step (what that takes, in order: its
    body, a commented line each); `close` writes the summary.
"""

from __future__ import annotations

import sys

if __name__ in ("__main__", "__mp_main__"):   # (each worker of --nproc N runs these lines too)
    from nanohlat.run import startup   # Ctrl-C or SIGTERM before training: one line and 130 / 143,
    startup.guard()                    # even in the middle of an import (run/startup.py)

import torch

from nanohlat import optim
from nanohlat.data_parallel import global_mean, split_batch
from nanohlat.run import preflight
from nanohlat.run.build import build, mesh as build_mesh
from nanohlat.run.session import Session


def train(model_cfg, tcfg, ds, resume_from: str | None, dev, rank: int = 0, world: int = 1) -> dict:
    """Run (or resume from `resume_from`) training as rank `rank` of `world` on the device `dev`,
    on the prepared dataset `ds` (preflight.py decides all of them). Returns a summary (rank 0's view)."""
    # -- the mesh: rank <-> (dp, pp, tp), its process groups (the layout was validated in pre-flight) ----
    mesh = build_mesh(model_cfg, tcfg, world, rank)   # (mesh.py; run/build.py:mesh)
    mesh.build_groups(dev if world > 1 else None)

    # -- model (this rank's stage and tensor slice), schedule, optimizer -----
    model, runner, opt = build(model_cfg, tcfg, mesh, dev)

    # -- resume from the checkpoint, open the log (prints, metrics.jsonl) ----
    session = Session(model_cfg, tcfg, mesh, dev, model, runner, opt, ds, resume_from)

    # -- the loop: the global batch of step k depends only on (seed, k) ------
    tokens_per_step = tcfg.batch_size * tcfg.seq_len
    for step in range(session.start_step, tcfg.steps):
        lr = optim.cosine_lr(step, tcfg.lr, tcfg.min_lr, tcfg.warmup_steps, tcfg.steps)
        batch = ds.batch(step, tcfg.batch_size, tcfg.seq_len, tcfg.seed)   # (B, T + 1) tokens, on every rank
        tokens, targets = split_batch(batch, mesh, tcfg, dev)               # this rank's micro-batches
        opt.zero_grad()
        # forward + backward of every micro-batch; each loss is scaled by 1 / the GLOBAL token count,
        # so gradients summed over micro-batches and dp ranks are the gradient of the batch's mean loss
        loss = global_mean(runner.run(tokens, targets, 1.0 / tokens_per_step), mesh)   # (all-reduces: pp, dp)
        # the optimizer step (optim.py), phase by phase. The gradients are already in its flat fp32
        # buffers: each p.grad went there as autograd made it (optim.py:FlatAdamW.attach: a hook, or a view)
        grads = opt.reduce_gradients()          # DP: all-reduce; ZeRO-1: reduce-scatter (overlapped: waits)
        norm = opt.global_grad_norm(grads)      # one number: all-reduces of 4 bytes over tp, pp (ZeRO: dp)
        finite = torch.isfinite(norm) & torch.isfinite(loss)   # a non-finite step updates nothing
        opt.update(grads, lr, norm, finite)             # clip + AdamW on the master (ZeRO-1: its shard)
        opt.write_back()                                # ZeRO-1: all-gather the shards into the parameters
        del grads                                       # (ZeRO-1's reduced shard: not kept to the next step)
        # the end of the step, and what a run does between steps (run/session.py:Session.end_step)
        if session.end_step(step + 1, loss, norm, finite, lr):
            break
    return session.close()


def main(argv: list[str] | None = None) -> int:
    """The command line: pre-flight once (nanohlat/run/preflight.py), then `train`
    here, in --nproc local workers, or as this torchrun rank. Returns the exit code:
    0, 2 (refused, one line on stderr), 130 / 143 (stopped by Ctrl-C / SIGTERM, saved)."""
    return preflight.main(train, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
