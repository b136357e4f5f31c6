"""The helpers the plan's tests share (tests/plan/). nanohlat/plan/, the arithmetic behind
`train.py --plan`, is held to two standards.

1. Hand arithmetic at full scale (test_plan_at_full_scale.py; the step time and the layout
   search: test_plan_step_time_and_search.py). HLAT-7B's own layout (64 trn1.32xlarge =
   2048 NeuronCores, tp 8, dp 256) and HLAT-70B's (tp 32, pp 8, ZeRO-1) plan
   in well under 5 s, with LLaMA-2's parameter counts worked out (`llama_params`).

2. What small real runs measure (tiny preset, CPU, gloo):
   * the comm ledger of the first step, per collective, on rank 0, and the
     optimizer's state bytes and most micro-batches in flight on rank 0
     (train.py writes all three to <out_dir>/summary.json; `assert_run_matches_plan`):
     test_plan_against_runs.py, and test_plan_moe_expert_parallel.py for a mixture of experts;
   * the bytes autograd keeps at the end of one micro-batch's forward,
     counted tensor by tensor (`LiveBytes`), for every checkpointing mode,
     with and without sequence parallelism, on first, middle and last stages
     (test_plan_against_runs.py);
   * peak memory (test_plan_peak_memory.py): on CUDA torch.cuda.max_memory_allocated
     counts our tensors; on the CPU the process's peak (ru_maxrss) counts Python and
     torch's libraries too, so the test reads the allocator's own reports instead (the
     profiler's memory profiling: every allocation and free, `allocator_peak` below) and
     holds the plan's peak to an upper bound at most 10% above it.
   On the CPU they agree to the byte today; on CUDA (H200, torch 2.11) within
   3%, where the loss backward's transients and the unfused AdamW's
   temporaries are modelled from measurement. Each is held to 10%.

test_plan_cp.py and test_plan_moe.py hold the plans of context parallelism and of a mixture
of experts to the same standards, with these helpers.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import time
import warnings

import torch

from nanohlat import recipe
from nanohlat.run import preflight
from nanohlat import plan
from nanohlat.beyond.context_parallel import ContextMesh


TOL = 0.10


def close(measured: int, predicted: int) -> bool:
    return abs(measured - predicted) <= TOL * max(abs(measured), 1)


def llama_params(L, d, heads, kv_heads, ffn, vocab):
    """LLaMA-2 without biases: per layer wq wo (d x d), wk wv (d x kv), gate up
    down (d x ffn), two norms; untied embedding and head; final norm."""
    kv = d // heads * kv_heads
    return L * (2 * d * d + 2 * d * kv + 3 * d * ffn + 2 * d) + 2 * vocab * d + d


def plan_in_seconds(preset: str, world: int = 2048):
    """(model, train config, the --plan text), asserting the plan took < 5 s."""
    model, train = recipe.parse_args(["--preset", preset])
    t0 = time.perf_counter()
    text = plan.report(model, train, world)
    assert time.perf_counter() - t0 < 5
    return model, train, text


TINY = ["--preset", "tiny", "--batch-size", "8", "--seq-len", "32"]


BASE = ["--preset", "tiny", "--steps", "1", "--eval-every", "0", "--batch-size", "8", "--seq-len", "32", "--device", "cpu"]


class LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of the storages created inside the `with` block that are still
    alive when asked. Every op's outputs pass through __torch_dispatch__; a
    weak reference to each new storage tells, later, whether autograd (or
    anyone) kept it. Storages that existed before (parameters, buffers,
    inputs) are never counted, views add nothing."""

    def __init__(self, existing: set):
        super().__init__()
        self.existing, self.seen = existing, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                key = s.data_ptr()
                old = self.seen.get(key)
                if key not in self.existing and (old is None or old[0].expired()):
                    self.seen[key] = (StorageWeakRef(s), s.nbytes())
        return out

    def alive(self) -> int:
        """The bytes alive once the figure holds for 4 reads 10 ms apart: a tensor held only by a
        reference cycle is garbage, just not yet freed (gc.collect), and gloo's worker thread can
        let go of a collective's output a moment after the call returned (seen once in ~7 runs:
        one all-gather buffer more). What autograd keeps stays, however long one waits."""
        gc.collect()
        reads = []
        while (len(reads) < 4 or len(set(reads[-4:])) > 1) and len(reads) < 100:
            if reads:
                time.sleep(0.01)
            reads.append(sum(n for ref, n in self.seen.values() if not ref.expired()))
        return reads[-1]


def forward_bytes(argv, group=None, pp=1, stage=0) -> tuple[int, int]:
    """(measured, planned) bytes kept after one micro-batch's forward on a rank
    of `stage`, as PipelineRunner runs it: a later stage clones its received
    input and requires its grad; a non-last stage's output is kept for backward."""
    from nanohlat.device import get_device
    from nanohlat.model import Transformer, init_weights
    from nanohlat.beyond.schedules import stage_layers
    from nanohlat.precision import param_dtype
    cfg, t = recipe.parse_args(argv)
    tp = group.size if group is not None else 1
    first, last = stage == 0, stage == pp - 1
    model = Transformer(cfg, group, t.sequence_parallel, stage_layers(cfg.n_layers, pp, stage), first, last,
                        sp_regather=t.sp_regather)
    init_weights(model, t.seed)
    dtype = param_dtype(t.precision)
    model.to(dtype=dtype)
    model.set_activation_checkpointing(t.activation_checkpointing, get_device("cpu").checkpoint)
    mb = t.batch_size // t.microbatches
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, cfg.vocab_size, (mb, t.seq_len + 1), generator=g)
    tokens, targets = batch[:, :-1], batch[:, 1:]
    T = t.seq_len // tp if (model.sequence_parallel and not first) else t.seq_len
    received = torch.randn(mb, T, cfg.d_model, generator=g).to(dtype)
    existing = {x.untyped_storage().data_ptr() for x in [*model.parameters(), *model.buffers()]}
    with LiveBytes(existing) as live:
        x = tokens if first else received.clone().requires_grad_()
        out = model(x, targets).sum() if last else model(x)
    measured = live.alive() - (out.numel() * out.element_size() if last else 0)   # the loss scalar is no activation
    return measured, plan.activation_bytes(cfg, t, tp, pp, 1, stage)


def assert_run_matches_plan(out_dir, argv, world):
    with open(os.path.join(out_dir, "summary.json")) as f:
        measured = json.load(f)
    model, train = recipe.parse_args(argv)
    dp = world // (train.tp * train.pp * train.cp)
    predicted = plan.comm_per_step(model, train, ContextMesh(train.tp, train.pp, dp, 0, cp=train.cp))
    # payload, wire, padding and calls of every collective, to the byte
    for figure, name in (("payload", "comm_bytes"), ("wire", "comm_wire_bytes"),
                         ("padding", "comm_padding_bytes"), ("calls", "comm_calls")):
        assert measured[name] == {k: v[figure] for k, v in predicted.items()}, figure
    # what the rank keeps between steps, by kind, to the byte (padding to a multiple of dp included)
    mem = plan.memory_per_rank(model, train, train.tp, train.pp, dp, 0)
    assert (measured["param_bytes"], measured["grad_bytes"], measured["optimizer_bytes"]) == \
        (mem["weights"], mem["flat_grads"], mem["optimizer"])
    assert measured["peak_in_flight"] == plan.microbatches_in_flight(train.schedule, train.pp,
                                                                     train.microbatches, 0)


def _balanced_routing(rank):
    """Token j of a micro-batch (flattened) picks experts j, j+1, ... (mod E): every expert, so every
    ep rank, gets N*k/E choices from each rank, the balanced routing the plan predicts the
    all-to-alls for. Patched into each worker before it trains (run_layouts' setup)."""
    from nanohlat.beyond import moe
    route = moe.route

    def balanced(x, w_router, k, seq_group=None, bias=None):
        experts, weights, balance, z = route(x, w_router, k, seq_group, bias)
        B, T, E = x.shape[0], x.shape[1], w_router.shape[0]
        j = torch.arange(B * T, device=x.device).view(B, T, 1) + torch.arange(k, device=x.device)
        return j % E, weights, balance, z
    moe.route = balanced


# On the CPU, the allocator's own figure: with the profiler's memory profiling on, c10's CPU
# allocator reports the allocations and frees made on the profiled (main) thread, so the bytes
# our tensors hold at each moment are a running sum, and a step's peak its maximum. Three steps
# of train.train, the profiler on from before build(): a step is from its split_batch to its
# end_step, and its peak counts everything this rank allocated since (weights, Adam, buffers,
# rotary tables: what the plan's peak counts).
#
# One thing the profiler cannot see: a free made on one of gloo's own threads. A collective's
# work object holds the tensors it was given (and any copy gloo made of them); when gloo's
# thread drops the work after the program has already dropped its own references (a blocking
# exchange's input the caller lets go of at once), the last reference goes on gloo's thread,
# a few microseconds after the collective completed, and no free is reported: read naively,
# the block stays alive until its address is reused, sometimes into the next step, and the
# same run measures a different peak depending on which thread won. So every collective comm
# makes is watched (`_watch_collectives`): a block the collective held whose free was never
# reported is counted as freed when the program's wait for that collective returned (for a
# blocking one, when its call returned), which is when gloo lets go of it, to the microsecond.

def _mark_done(key: int) -> None:
    """Mark, in the profile, the moment the program saw collective `key` end."""
    from torch.profiler import record_function
    with record_function(f"COLLECTIVE_DONE {key}"):
        pass


class _Watched:
    """A collective's work: its wait() marks the moment the program saw it end (_mark_done)."""

    def __init__(self, work, key: int):
        self._work, self._key = work, key

    def wait(self, *args, **kwargs):
        done = self._work.wait(*args, **kwargs)
        _mark_done(self._key)
        return done

    def __getattr__(self, name):
        return getattr(self._work, name)


def _watch_collectives():
    """Wrap the torch.distributed calls comm.py makes: each call is a profile span named with the
    storages it was given, and its end is marked (blocking) or its work's wait() is (async).
    Returns the undo."""
    import torch.distributed as dist
    from torch.profiler import record_function
    from nanohlat import comm
    keys = itertools.count()

    def tensors_in(args, kwargs):
        for a in list(args) + list(kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else [a]):
                t = getattr(t, "tensor", t)   # a P2POp holds its tensor
                if isinstance(t, torch.Tensor):
                    yield t

    def watched(fn):
        def call(*args, **kwargs):
            key = next(keys)
            storages = " ".join(str(t.untyped_storage().data_ptr()) for t in tensors_in(args, kwargs))
            with record_function(f"COLLECTIVE {key} {storages}"):
                work = fn(*args, **kwargs)
            if work is None:
                _mark_done(key)
                return None
            return [_Watched(w, key) for w in work] if isinstance(work, list) else _Watched(work, key)
        return call

    class Dist:   # torch.distributed, its collectives watched
        def __getattr__(self, name):
            return getattr(dist, name)
    proxy = Dist()
    for name in ("all_reduce", "all_to_all_single", "batch_isend_irecv"):
        setattr(proxy, name, watched(getattr(dist, name)))
    saved = comm.dist, comm._all_gather_tensor, comm._reduce_scatter_tensor
    comm.dist, comm._all_gather_tensor, comm._reduce_scatter_tensor = \
        proxy, watched(comm._all_gather_tensor), watched(comm._reduce_scatter_tensor)

    def undo():
        comm.dist, comm._all_gather_tensor, comm._reduce_scatter_tensor = saved
    return undo


def live_bytes_timeline(events, alive_after: set[int]) -> list[tuple[int, int, str | None]]:
    """(time, change in bytes held, marker name) from a profile's events, frees made on gloo's
    threads placed at their collective's end (see above). A block never freed nor reused is
    still alive if a tensor still holds it (`alive_after`: the storages Python still sees)."""
    from torch._C._profiler import _EventType

    def walk(es):
        for e in es:
            yield e
            yield from walk(e.children)
    events = sorted(walk(events), key=lambda e: e.start_time_ns)
    blocks = []            # [alloc time, size, (how, when) freed or None, collectives that held it, address]
    alive = {}             # ptr -> index in blocks
    done = {}              # collective -> when the program saw it end
    spans = []             # (end time, key) of the collective calls being made
    marks = []
    for e in events:
        t = e.start_time_ns
        spans = [(end, key) for end, key in spans if t < end]
        if e.typed[0] == _EventType.Allocation:
            f = e.typed[1]
            if f.alloc_size > 0:
                if f.ptr in alive:       # an address reused: its free went unreported
                    blocks[alive[f.ptr]][2] = ("reused", t)
                alive[f.ptr] = len(blocks)
                blocks.append([t, f.alloc_size, None, {key for _, key in spans}, f.ptr])   # (in a span: gloo's copy)
            elif f.ptr in alive:         # (a free of a block from before this profile is not ours)
                blocks[alive.pop(f.ptr)][2] = ("freed", t)
        elif e.name.startswith("COLLECTIVE "):
            key, *storages = e.name.split()[1:]
            spans.append((e.end_time_ns, key))
            for ptr in storages:
                if int(ptr) in alive:
                    blocks[alive[int(ptr)]][3].add(key)
        elif e.name.startswith("COLLECTIVE_DONE "):
            done.setdefault(e.name.split()[1], t)
        elif e.name in ("STEP_START", "STEP_END"):
            marks.append((t, 0, e.name))
    changes = list(marks)
    for start, size, free, held, ptr in blocks:
        changes.append((start, size, None))
        if free is not None and free[0] == "freed":
            changes.append((free[1], -size, None))
            continue
        ends = [done[k] for k in held if k in done and done[k] >= start]
        if ends and (free is not None or ptr not in alive_after):   # freed on gloo's thread as its collective ended
            end = max(ends)
            changes.append((min(end, free[1]) if free else end, -size, None))
        elif free:
            changes.append((free[1], -size, None))
    return sorted(changes, key=lambda c: (c[0], c[1] > 0))   # at one instant, frees first


def allocator_peak(argv, rank=0, world=1) -> tuple[int, int, int]:
    """(stage, the highest step peak of this rank's allocations, the plan's peak for its stage)."""
    import train
    from torch.profiler import ProfilerActivity, profile, record_function
    from nanohlat.run import session
    model_cfg, tcfg = recipe.parse_args(argv + ["--no-progress", "--threads", "1"])
    inputs = preflight.inputs(model_cfg, tcfg, world, rank)
    split, end = train.split_batch, session.Session.end_step

    def marked_split(*a, **k):
        with record_function("STEP_START"):
            pass
        return split(*a, **k)

    def marked_end(self, *a, **k):
        with record_function("STEP_END"):
            pass
        return end(self, *a, **k)
    train.split_batch, session.Session.end_step = marked_split, marked_end
    undo = _watch_collectives()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            train.train(*inputs)
    finally:
        train.split_batch, session.Session.end_step = split, end
        undo()
    alive_after = set()
    with warnings.catch_warnings():   # (isinstance on every object touches deprecated names)
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            if isinstance(o, torch.Tensor):
                try:
                    alive_after.add(o.untyped_storage().data_ptr())
                except RuntimeError:   # a tensor with no data (an earlier torch.compile's fake ones)
                    pass
    live, peak, step = 0, 0, None
    for _, change, mark in live_bytes_timeline(prof.profiler.kineto_results.experimental_event_tree(), alive_after):
        live += change
        if step is not None:
            step = max(step, live)
        if mark == "STEP_START":
            step = live
        elif mark == "STEP_END":
            peak, step = max(peak, step), None
    dp = world // (tcfg.tp * tcfg.pp * tcfg.cp)
    stage = ContextMesh(tcfg.tp, tcfg.pp, dp, rank, cp=tcfg.cp).pp_rank
    return stage, peak, plan.memory_per_rank(model_cfg, tcfg, tcfg.tp, tcfg.pp, dp, stage, fused=True, eager=True)["peak"]


def _peak_worker(rank, world, runs, out_dir):
    results = [allocator_peak(argv + ["--out-dir", os.path.join(out_dir, f"run{i}")], rank, world)
               for i, argv in enumerate(runs)]
    with open(os.path.join(out_dir, f"peaks{rank}.json"), "w") as f:
        json.dump(results, f)
