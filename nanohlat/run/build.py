"""Build what a training step runs on this rank: its mesh, the model, its pipeline runner, its optimizer.

train.py and bench.py both call `build`, so the benchmark times exactly the
step that training runs (same placement, dtype, checkpointing and schedule).
This is also the one place where the layouts beyond HLAT's recipe are switched
on, each by one call, in the order a rank is put together: the mesh's extra
dimensions (`mesh`), then the model's parts (`build`: experts, attention across
the cp ranks, FP8 linears, split linears), then the schedule's runner and the optimizer's
strategy. Each extension is imported where its flag is handled, so a run of
HLAT's recipe (tp, sp, pp with AFAB or 1F1B, dp with ZeRO 0 or 1) builds from
the core alone and never loads nanohlat/beyond/ (tests/run/test_core_runs_alone.py).
The core (train.py, nanohlat/*.py) does not know the extensions: each goes in
through a seam the core declares (docs/design.md 1 lists them).
"""

from __future__ import annotations

import contextlib
import functools

from nanohlat import comm, mesh as meshlib, optim, pipeline
from nanohlat.tools import comm_trace, timeline
from nanohlat.tools.compile import compile_stage
from nanohlat.tools.fast_adamw import FastFlatAdamW
from nanohlat.model import Transformer, init_weights
from nanohlat.precision import param_dtype


def mesh(model_cfg, tcfg, world: int, rank: int) -> meshlib.Mesh:
    """This rank's mesh (groups not built): world = dp x pp x tp (mesh.py); with --cp a cp dimension
    between tp and dp (context_parallel.ContextMesh); with --ep the expert groups carved out of dp (with
    --cp out of dp x cp: moe.add_groups);
    with the interleaved schedule the last stage <-> first stage pairs an odd pp lacks (schedules.py)."""
    tp, pp, cp = tcfg.tp, tcfg.pp, tcfg.cp
    args = (tp, pp, world // (tp * pp * cp), rank, comm.CommLedger(), {}, meshlib.kv_replicas(model_cfg, tp))
    if cp > 1:
        from nanohlat.beyond import context_parallel
        m = context_parallel.ContextMesh(*args, cp=cp)
    else:
        m = meshlib.Mesh(*args)
    if tcfg.ep > 1:
        from nanohlat.beyond import moe
        moe.add_groups(m, tcfg.ep)
    if tcfg.schedule == "interleaved":
        from nanohlat.beyond import schedules
        m.extra["pair_wrap"] = schedules.wrap_groups
    return m


def build(model_cfg, tcfg, mesh, dev):
    """(model, runner, opt) for this rank of `mesh`, on `dev`.

    model:  this rank's pipeline stage and tensor slice, initialised
            layout-independently (every layout starts from the same weights),
            in the parameter dtype of --precision (compiled with --compile);
    runner: the micro-batch schedule (--schedule) that runs forward/backward
            (timed op by op with --timeline: tools/timeline.py:StepClock);
    opt:    AdamW over this rank's parameters (ZeRO-1, 2, 3 with --zero; its
            update torch's fused kernel on the CPU, compiled with --compile elsewhere).
    """
    # the stage's layers: one contiguous run (pipeline.py), or --virtual-stages chunks (schedules.chunk_layers)
    runner_class, layers = pipeline.PipelineRunner, pipeline.stage_layers(model_cfg.n_layers, mesh.pp, mesh.pp_rank)
    if tcfg.schedule in ("interleaved", "zb-h1"):
        from nanohlat.beyond import schedules
        runner_class = schedules.runner(tcfg.schedule)
        layers = schedules.stage_layers(model_cfg.n_layers, mesh.pp, mesh.pp_rank, tcfg.virtual_stages)
    model = decoder(model_cfg, mesh.tp_group, tcfg.sequence_parallel, layers, first=mesh.is_first_stage,
                    last=mesh.is_last_stage, kv_group=mesh.group("kv"), sp_regather=tcfg.sp_regather,
                    ep_group=mesh.group("ep"), router_scale=1.0 / tcfg.batch_size,
                    cp_group=mesh.group("cp") if tcfg.cp > 1 else None)
    eager = []   # (--compile: what an extension runs eagerly, between graphs)
    if tcfg.cp > 1:   # context parallelism: attention across the cp ranks, each token rotated at its place
        from nanohlat.beyond import context_parallel
        context_parallel.apply(model, mesh.group("cp"), tcfg.cp_attention)
        # (its collectives, the ring's started shifts and their waits, inside autograd Functions)
        eager.append((context_parallel.Context, "attention"))
    if model_cfg.moe_experts:
        from nanohlat.beyond import moe
        # (the dispatches whose shapes are the step's tokens per expert, --ep's all-to-alls, capacity's queues)
        eager.append((moe.MoE, "dispatch_on_host"))
    fp8_run = None
    if tcfg.fp8 != "none":   # --fp8: the blocks' linears and experts with each matmul in FP8, around the same weights
        from nanohlat.beyond import fp8
        cp_group = mesh.group("cp") if tcfg.cp > 1 else None
        fp8_run = fp8.apply(model, fp8.Fp8Run(tcfg.fp8, tcfg.fp8_grad_format, cp_group, model.token_positions,
                                              tcfg.fp8_history, tcfg.fp8_margin))
        if model_cfg.moe_experts:
            from nanohlat.beyond import fp8_experts
            fp8_experts.apply(model, fp8_run)
    if tcfg.schedule == "zb-h1":   # ZB-H1: linears whose weight gradients can wait for the W ops
        from nanohlat.beyond import split_backward
        split_backward.apply(model)
    init_weights(model, tcfg.seed)
    dtype = param_dtype(tcfg.precision)
    dev.place(model, dtype)   # = model.to(device, dtype), keeping each parameter's `shard` (its ShardSpec)
    model.set_activation_checkpointing(tcfg.activation_checkpointing, dev.checkpoint)
    if tcfg.compile:
        compile_stage(model, dev.kind, eager)   # --compile: torch.compile the stage in place (compile.py)
    mb = tcfg.batch_size // (mesh.dp * tcfg.microbatches)   # sequences per micro-batch
    seq_local = tcfg.seq_len // tcfg.cp // (mesh.tp if model.sequence_parallel else 1)   # (--cp: T/cp tokens)
    # --timeline: the runner tells a StepClock the start and end of every forward and backward
    clock = timeline.StepClock(dev, synchronize=True) if tcfg.timeline else None
    runner = runner_class(model, mesh, tcfg, (mb, seq_local, model_cfg.d_model), dtype, dev, clock)
    opt = optimizer(model, mesh, tcfg, dev)
    if model_cfg.moe_experts and model_cfg.moe_bias_rate:
        # --moe-bias-rate: the experts' biases move in the optimizer step, by the global batch's load
        opt.step_hooks.append(functools.partial(model.step_figures.move_biases, mesh, dev.torch_device))
    if tcfg.fp8 == "delayed":   # each operand's amax of the step into its history, the next step's scales from it
        opt.step_hooks.append(functools.partial(fp8.end_step, fp8_run, (mesh.tp_group, mesh.grad_group)))
    if tcfg.fp8_stats:   # --fp8-stats: the FP8 figures logged beside the step's (a mixture's too)
        from nanohlat.beyond import fp8_stats
        model.step_figures = fp8_stats.Figures(fp8_run, model_cfg, tcfg.fp8_stats, model.step_figures)
    if clock and opt.dp.group.size > 1:
        # --timeline: the dp group (the DP strategy's, the loss's: mesh.grad_group, dp x cp with --cp) tells a
        # CommTrace when each of its collectives in a step is issued and ends, and what it is
        clock.trace = comm_trace.CommTrace(clock, opt)
        opt.dp.group.trace = clock.trace
    if clock and tcfg.cp > 1:
        # --timeline --cp: the cp group's collectives, and the attention they serve, timed the same way
        clock.cp_trace = mesh.group("cp").trace = comm_trace.CommTrace(clock)
    # xla: make the optimizer's new buffers device data now, so that the first step's graphs
    # read them as every later step does (else one more compile)
    dev.sync()
    return model, runner, opt


def decoder(model_cfg, group=None, sequence_parallel: bool = False, layers=None, first: bool = True,
            last: bool = True, kv_group=None, sp_regather: bool = True, ep_group=None,
            router_scale: float = 0.0, cp_group=None) -> Transformer:
    """The decoder (a pipeline stage of it: model.Transformer's arguments), with a mixture of experts in
    place of the sparse layers' MLPs when the model has one (moe.apply; `ep_group`: --ep's ranks;
    `router_scale`: each sequence's router losses' weight in the objective, 1 / the global batch's
    sequences in training, 0 elsewhere; `cp_group`: --cp's ranks, over which the router's sums over a
    sequence add up), whose figures of a step the run logs (model.step_figures, run/session.py). Its
    parameters are not filled yet (init_weights, or a checkpoint's load)."""
    model = Transformer(model_cfg, group, sequence_parallel, layers, first, last, kv_group, sp_regather)
    if model_cfg.moe_experts:
        from nanohlat.beyond import moe
        model.step_figures = moe.apply(model, model_cfg, ep_group, router_scale, cp_group)
    return model


def optimizer(model, mesh, tcfg, dev):
    """AdamW over this rank's parameters, with --zero's strategy: 0 and 1 the core's (optim.py), 2 and 3
    ZeRO-2's and ZeRO-3's (zero2.py, zero3.py: ZeRO-3's units then hooked to the model's layers); its passes
    torch's fused AdamW kernel on the CPU or compiled with --compile (tools/fast_adamw.py: FlatAdamW's
    numbers, to a bound its test derives)."""
    strategy = None
    if tcfg.zero == 2:
        from nanohlat.beyond import zero2
        strategy = zero2.ZeroTwoDP
    if tcfg.zero == 3:
        from nanohlat.beyond import zero3
        strategy = zero3.ZeroThreeDP
    opt = (FastFlatAdamW if dev.kind == "cpu" or tcfg.compile else optim.FlatAdamW)(model, mesh, tcfg, dev, strategy)
    if tcfg.compile:
        opt.compile()   # and the optimizer's arithmetic (FastFlatAdamW.compile)
    if tcfg.zero == 3:   # (never with --compile: the recipe refuses the pair)
        zero3.attach(model, opt.groups)   # each layer's flat buffers gathered, freed together (Shard.unit)
    return opt


def whole_params(opt, quiet: bool = False):
    """A `with` in which every parameter is whole on this rank: under --zero 3 each layer gathered, then
    each rank keeps its shard of the result (zero3.whole; quiet: off the comm ledger); else nothing to do."""
    if opt is None or opt.tcfg.zero != 3:
        return contextlib.nullcontext()
    from nanohlat.beyond import zero3
    return zero3.whole(opt, quiet)
