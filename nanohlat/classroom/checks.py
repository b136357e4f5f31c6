"""The checks behind `python -m nanohlat.classroom check`: one oracle per exercise.

Every check returns None (pass) or a verdict a student can act on: what was
computed, on which rank, where it first differs from the oracle and by how
much. The oracles are written here, independently of the code they check:
plain dense PyTorch for the parallel layers, hand-derived timetables for the
schedules, exhaustive enumeration for the mesh. A check never compares the
student's code with itself.

A verdict on the student's code starts with the name of the case that caught
it ("large logits (about +-95, padding logits 100)", "odd NaN and infinity
bit patterns", "kv heads shared by ranks (tp > n_kv_heads)"): realistic and
hostile inputs and every code path of the exercised function are cases of
their own, so a student sees which one. (Not "not done yet", a stub's, nor a
hang's, which names the ranks that never finished.)

An exercise that moves data is checked on what it moves, too, once its values
are right (`Wire` below): every collective a rank calls is recorded where it
enters torch.distributed, and its kind, its process group, the number of
calls and the bytes a ring implementation puts on the wire are held against
the oracle's ("right values, but 1536 bytes on the wire where 768 suffice").
A cheaper way to the same values passes; a dearer one, or one on the wrong
group, fails. (The bucketed 3a-3d must also make exactly one call per bucket.)

Distributed checks run `world` gloo processes on the CPU (`spawn` below); each
returns its own verdict, and the first failing rank's is reported. A rank
stuck in a collective that its peers never called is stopped at the time
limit, and the verdict says so: it is the typical symptom of a collective
called on some ranks only.
"""

from __future__ import annotations

import os
import re
import traceback
from fractions import Fraction

import torch

TOL = dict(rtol=1e-5, atol=1e-5)   # fp32 round-off of the same sums added in another order
TIME_LIMIT = float(os.environ.get("NANOHLAT_CHECK_TIME_LIMIT", "120"))   # seconds for one distributed check, start-up included


# ---------------------------------------------------------------------------
# Verdicts
# ---------------------------------------------------------------------------

def compare(what: str, got, want, rank: int | None = None, rtol=TOL["rtol"], atol=TOL["atol"]) -> str | None:
    """None when `got` equals `want` within tolerance, else a one-paragraph verdict."""
    where = f" on rank {rank}" if rank is not None else ""
    if not isinstance(got, torch.Tensor):
        return f"{what}{where}: expected a tensor, got {type(got).__name__}"
    if tuple(got.shape) != tuple(want.shape):
        return f"{what}{where}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    got64, want64 = got.detach().double(), want.detach().double()
    bad = ~((got64 - want64).abs() <= atol + rtol * want64.abs())
    bad |= torch.isnan(got64) != torch.isnan(want64)
    if not bad.any():
        return None
    idx = tuple(int(i) for i in bad.nonzero()[0])
    diff = (got64 - want64).abs().nan_to_num(float("inf"))
    return (f"{what}{where} differs from the oracle in {int(bad.sum())} of {bad.numel()} elements; "
            f"first at index {list(idx)}: got {got64[idx].item():.6g}, expected {want64[idx].item():.6g} "
            f"(largest difference {diff.max().item():.3g}; tolerance {atol:g} + {rtol:g} x |expected|)")


_CASE = {"name": None}   # the case a check is running, named in an error raised during it


def case(name: str) -> str:
    """Mark the start of a named case: an exception raised from here on names it."""
    _CASE["name"] = name
    return name


STUB = re.compile(r"exercise (\d+[a-z]): .*?, see tutorial\.md section \d+")


def explain(e: BaseException, exercise: str | None = None) -> str:
    """A student's exception as a verdict: a stub (this exercise's, or one it
    needs first; the stub's message may arrive wrapped in another error), or
    where their code raised."""
    stub = STUB.search(str(e))
    if stub:
        if exercise and stub.group(1) != exercise:
            return f"not done yet: exercise {exercise} needs exercise {stub.group(1)} first ({stub.group(0)})"
        return f"not done yet: {stub.group(0)}"
    tb = traceback.extract_tb(e.__traceback__)
    mine = [f for f in tb if os.path.abspath(f.filename) != os.path.abspath(__file__)] or tb   # not this file
    at = f" at {os.path.relpath(mine[-1].filename)}:{mine[-1].lineno}" if mine else ""
    during = f"{_CASE['name']}: " if _CASE["name"] else ""
    return f"{during}raised {type(e).__name__}: {e}{at}"


def run(ex) -> str | None:
    """Run every check of exercise `ex`; the first verdict, or None when all pass."""
    for check in CHECKS[ex.id]:
        _CASE["name"] = None
        try:
            verdict = check()
        except Exception as e:   # the student's code raised (NotImplementedError for the stub)
            return explain(e, ex.id)
        if verdict:
            return verdict if not verdict.startswith("not done yet") else explain(Exception(verdict), ex.id)
    return None


# ---------------------------------------------------------------------------
# gloo workers
# ---------------------------------------------------------------------------

def _worker(rank, world, port, fn, args, queue):
    import datetime
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=TIME_LIMIT))
        Wire.install()
        try:
            verdict = fn(rank, world, *args)
        except Exception as e:
            verdict = explain(e)
        queue.put((rank, verdict))
        dist.destroy_process_group()
    except Exception as e:   # gloo itself failed (e.g. a peer died)
        queue.put((rank, explain(e)))


def spawn(fn, world: int, *args) -> str | None:
    """Run fn(rank, world, *args) on `world` gloo processes; the first failing rank's verdict."""
    import queue as queue_mod
    import torch.multiprocessing as mp
    from nanohlat.run.launch import free_port, start_method
    ctx = mp.get_context(start_method())
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    verdicts = {}
    import time
    deadline = time.monotonic() + TIME_LIMIT
    try:
        while len(verdicts) < world:
            try:
                rank, v = q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue_mod.Empty:
                break
            verdicts[rank] = v
    finally:
        for p in procs:
            p.join(timeout=5 if len(verdicts) == world else 0.1)
            if p.is_alive():
                p.kill()
    if len(verdicts) < world:
        stuck = [r for r in range(world) if r not in verdicts]
        return (f"rank(s) {stuck} did not finish within {TIME_LIMIT:.0f} s: usually a collective that only "
                f"some ranks call, so the others wait for it forever")
    for r in range(world):
        if verdicts[r]:
            return verdicts[r]
    return None


def tp_group(rank: int, world: int, name: str = "tp", ranks: list[int] | None = None):
    """A group of `ranks` (all `world` by default) as the model's layers expect it,
    on a process group of its own, not the default (world) one: a collective
    called on the default group instead of the one given is then seen (`Wire`).
    Every rank must make the same groups in the same order (torch.distributed's rule)."""
    import torch.distributed as dist
    from nanohlat import comm, mesh
    group_cls = getattr(comm, "Group", None) or mesh.Group
    ranks = list(range(world)) if ranks is None else ranks
    pg = dist.new_group(ranks)
    return group_cls(name, ranks, ranks.index(rank) if rank in ranks else -1, pg)


# ---------------------------------------------------------------------------
# What moves: every collective, recorded where it enters torch.distributed
# ---------------------------------------------------------------------------

def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


# torch.distributed function -> (kind, the argument whose bytes are the payload). The payload
# is nanohlat/comm.py's: the input of an all-reduce, the gathered output of an all-gather, the
# unreduced input of a reduce-scatter; the wire bytes follow from it as comm.wire_bytes says.
_COLLECTIVES = {
    "all_reduce": ("all_reduce", "tensor"), "all_gather": ("all_gather", "tensor_list"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"), "_all_gather_base": ("all_gather", "output_tensor"),
    "all_gather_single": ("all_gather", "output_tensor"), "reduce_scatter": ("reduce_scatter", "input_list"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"), "_reduce_scatter_base": ("reduce_scatter", "input"),
    "reduce_scatter_single": ("reduce_scatter", "input"), "all_to_all": ("all_to_all", "input_tensor_list"),
    "all_to_all_single": ("all_to_all", "input"), "broadcast": ("broadcast", "tensor"),
    "reduce": ("reduce", "tensor"), "gather": ("gather", "tensor"), "scatter": ("scatter", "tensor"),
    "send": ("send", "tensor"), "recv": ("recv", "tensor"), "isend": ("send", "tensor"), "irecv": ("recv", "tensor"),
}


def _wire(kind: str, n: int, payload: int) -> Fraction:
    """A ring's bytes on the wire from one rank (comm.wire_bytes' formulas, not rounded down
    per call: a check's small buckets would otherwise make more calls look cheaper)."""
    if kind == "all_reduce":
        return Fraction(2 * (n - 1) * payload, n)
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return Fraction((n - 1) * payload, n)
    return Fraction(payload)


class Wire:
    """The collectives this rank called since `reset`: (kind, process group, payload, wire bytes).

    `install` wraps torch.distributed's collectives (and nanohlat/comm.py's
    references to them) in this worker process, so a collective is seen
    whether the student calls nanohlat.comm, torch.distributed or
    torch.distributed.nn. Wire bytes are a ring implementation's, as the comm
    ledger counts them: all-reduce 2 (n-1)/n x S, all-gather and
    reduce-scatter (n-1)/n x S; anything else, the whole payload."""

    calls: list = []
    _depth = [0]

    @classmethod
    def reset(cls) -> None:
        cls.calls = []

    @classmethod
    def install(cls) -> None:
        import inspect
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
        wrapped = {}
        for name, (kind, arg) in _COLLECTIVES.items():
            orig = getattr(dist, name, None)
            if orig is None or orig in wrapped:
                continue
            wrapped[orig] = cls._wrap(orig, kind, arg, inspect.signature(orig))
            setattr(dist, name, wrapped[orig])
            if getattr(c10d, name, None) is orig:
                setattr(c10d, name, wrapped[orig])
        from nanohlat import comm
        for alias, value in list(vars(comm).items()):   # comm binds some at import (_all_gather_tensor ...)
            if callable(value) and value in wrapped:
                setattr(comm, alias, wrapped[value])

    @classmethod
    def _wrap(cls, orig, kind, arg, sig):
        import torch.distributed as dist

        def collective(*args, **kwargs):
            outer = cls._depth[0] == 0    # one call, even if torch implements it with another
            cls._depth[0] += 1
            try:
                if outer:
                    bound = sig.bind_partial(*args, **kwargs).arguments
                    pg = bound.get("group") or dist.group.WORLD
                    n = dist.get_world_size(pg)
                    payload = _nbytes(bound.get(arg))
                    cls.calls.append((kind, pg, payload, _wire(kind, n, payload)))
                return orig(*args, **kwargs)
            finally:
                cls._depth[0] -= 1
        return collective


def _describe(calls) -> str:
    """'1 all_reduce (96 bytes) + 2 all_gather (64 bytes)': calls and payload by kind."""
    if not calls:
        return "no collective"
    by = {}
    for kind, _, payload, _ in calls:
        n, b = by.get(kind, (0, 0))
        by[kind] = (n + 1, b + payload)
    return " + ".join(f"{n} {kind} ({b} bytes)" for kind, (n, b) in by.items())


def comm_verdict(what: str, group, want: list[tuple[str, int]], rank: int) -> str | None:
    """Hold the collectives recorded since `Wire.reset` against the oracle's `want`,
    [(kind, payload bytes), ...] on `group`. None when every call ran on `group`,
    with no more wire bytes and no more calls than the oracle's: a different
    kind that costs no more passes (an all-reduce with op MAX for the all-gather
    + max of the cross-entropy). Called once the values are right."""
    import torch.distributed as dist
    got = list(Wire.calls)
    want_calls = [(k, group.pg, p, _wire(k, group.size, p)) for k, p in want]
    for kind, pg, _, _ in got:
        if pg is not group.pg:
            which = "the default (world) process group" if pg is dist.group.WORLD else "another process group"
            article = "an" if kind[0] in "aeiou" else "a"
            return (f"{what} on rank {rank}: right values, but {article} {kind} ran on {which}, not on the {group.name} "
                    f"group it was given (ranks {group.ranks}): in a job with several {group.name} groups it "
                    f"would mix in ranks that hold other data (pass the group: group=...pg, or nanohlat.comm)")
    got_wire, want_wire = sum(c[3] for c in got), sum(c[3] for c in want_calls)
    if got_wire > want_wire:
        return (f"{what} on rank {rank}: right values, but {round(got_wire)} bytes on the wire where "
                f"{round(want_wire)} suffice (this rank called {_describe(got)}; {_describe(want_calls)} is enough)")
    if len(got) > len(want_calls):
        return (f"{what} on rank {rank}: right values, but {len(got)} collective call(s) where the oracle makes "
                f"{len(want_calls)} (this rank called {_describe(got)}; the oracle {_describe(want_calls)})")
    return None


# ---------------------------------------------------------------------------
# Chapter 1: the transformer
# ---------------------------------------------------------------------------

def bf16_steps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in bf16 steps: units of the spacing of bf16 numbers at |want|."""
    mag = want.double().abs().clamp_min(2.0 ** -126)
    step = torch.exp2(torch.floor(torch.log2(mag)) - 7)        # 7 stored mantissa bits
    return (got.double() - want.double()).abs() / step


def check_rmsnorm() -> str | None:
    from nanohlat.model import RMSNorm
    g = torch.Generator().manual_seed(11)
    D = 256
    cases = [("fp32 input", torch.float32),
             # a bf16 input must still be normalised in fp32: the exact result, rounded twice (the normalised
             # x to bf16, then its product with the bf16 weight), is at most 1.5 bf16 steps off; a mean of
             # squares and rsqrt computed in bf16 lands up to 2-3 steps off
             ("bf16 input, within 1.5 bf16 steps of the exact result", torch.bfloat16)]
    for name, dtype in cases:
        case(name)
        norm = RMSNorm(D, 1e-5, False).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(D, generator=g))
        x = (torch.randn(8, 16, D, generator=g) * 3 + 0.5).to(dtype)
        x[0, 0] = 1e-4   # a tiny vector: only eps keeps it finite (and small)
        y = norm(x)
        if y.dtype != dtype:
            return f"{name}: RMSNorm returned {y.dtype}; the output keeps the input's dtype ({dtype})"
        x64 = x.double()
        want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
        v = compare(f"{name}: the near-zero vector x = 1e-4 (only eps keeps it small)", y[0, 0], want[0, 0],
                    rtol=1e-2, atol=1e-5)
        if v:
            return v
        if dtype == torch.float32:
            v = compare(f"{name}: RMSNorm output", y, want, rtol=1e-5, atol=1e-5)
            if v:
                return v
            continue
        steps = bf16_steps(y, want)
        if not steps.max() <= 1.5:
            idx = [int(i) for i in (steps == steps.max()).nonzero()[0]]
            return (f"{name}: RMSNorm output is {steps.max().item():.2f} bf16 steps off the exact result at index "
                    f"{idx} (got {y[tuple(idx)].item():.6g}, exact {want[tuple(idx)].item():.6g}); "
                    f"{int((steps > 1.5).sum())} of {steps.numel()} elements are more than 1.5 steps off: "
                    f"normalise in fp32, round once at the end")
    return None


def check_rotary() -> str | None:
    from nanohlat.model import apply_rotary, rotary_tables
    D, T, theta = 16, 12, 10000.0
    cos, sin = rotary_tables(D, T, theta)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(2, 3, T, D, generator=g, dtype=torch.float64)
    y = apply_rotary(x, cos, sin)
    # oracle: pair (x_i, x_{i+D/2}) is the complex number x_i + i x_{i+D/2}, turned by t * theta^(-2i/D)
    freqs = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * freqs[None, :]     # (T, D/2)
    z = torch.complex(x[..., :D // 2], x[..., D // 2:]) * torch.polar(torch.ones_like(angle), angle)
    want = torch.cat([z.real, z.imag], dim=-1)
    case("x (2, 3, 12, 16) at positions 0..11")
    v = compare("x (2, 3, 12, 16) at positions 0..11: apply_rotary(x, *rotary_tables(16, 12, 1e4))", y, want)
    if v:
        return v
    # the property the tutorial promises: <rot(q, m), rot(k, n)> depends on m - n only
    case("relative positions")
    q, k = torch.randn(D, generator=g, dtype=torch.float64), torch.randn(D, generator=g, dtype=torch.float64)
    rq = apply_rotary(q.expand(1, 1, T, D), cos, sin)[0, 0]
    rk = apply_rotary(k.expand(1, 1, T, D), cos, sin)[0, 0]
    return compare("relative positions: <rot(q, 5), rot(k, 2)> vs <rot(q, 9), rot(k, 6)> (same distance)",
                   rq[5] @ rk[2], rq[9] @ rk[6])


def check_kv_cache() -> str | None:
    from nanohlat.config import ModelConfig
    from nanohlat.model import Transformer, init_weights
    from nanohlat.serving import generate as gen
    for n_kv in (4, 2):   # multi-head, then grouped-query attention
        cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=n_kv, ffn_dim=48, vocab_size=50,
                          max_seq_len=16)
        model = Transformer(cfg)
        init_weights(model, seed=13)
        tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(13))
        with torch.no_grad():
            want = model(tokens)                               # no cache: the whole sequence at once
            cache = gen.new_cache(model, 2, 12)
            # prefill 5 tokens, then a chunk of 3 (it must not see its own future), then one at a time
            pieces = [(0, 5), (5, 8)] + [(p, p + 1) for p in range(8, 12)]
            for a, b in pieces:
                name = case(f"positions {a}..{b - 1} fed with the KV cache holding 0..{a - 1} (n_kv_heads {n_kv})")
                got = gen.cached_forward(model, cache, tokens[:, a:b], torch.arange(a, b).expand(2, b - a))
                v = compare(f"{name}: logits", got, want[:, a:b], rtol=1e-4, atol=1e-5)
                if v:
                    return v
            # rows at different positions (a batch of prompts of different lengths): row 1's prompt is 3
            # tokens, right-padded to row 0's 5; its decoding overwrites the padding's cache columns, which
            # it must never see before
            name = case(f"ragged rows: row 0 at positions 5.., row 1 at 3.. over its padding (n_kv_heads {n_kv})")
            cache = gen.new_cache(model, 2, 12)
            pad = torch.randint(0, cfg.vocab_size, (2,), generator=torch.Generator().manual_seed(14))
            prompt = torch.stack([tokens[0, :5], torch.cat([tokens[1, :3], pad])])
            got = gen.cached_forward(model, cache, prompt, torch.arange(5).expand(2, 5))
            v = (compare(f"{name}: row 0's prompt logits", got[0], want[0, :5], rtol=1e-4, atol=1e-5)
                 or compare(f"{name}: row 1's prompt logits", got[1, :3], want[1, :3], rtol=1e-4, atol=1e-5))
            for j in range(4):
                if v:
                    return v
                pos = torch.tensor([[5 + j], [3 + j]])
                got = gen.cached_forward(model, cache, torch.stack([tokens[0, 5 + j:6 + j], tokens[1, 3 + j:4 + j]]), pos)
                v = compare(f"{name}: logits of row 0 at {5 + j} and row 1 at {3 + j}", got[:, 0],
                            torch.stack([want[0, 5 + j], want[1, 3 + j]]), rtol=1e-4, atol=1e-5)
            if v:
                return v
    return None


# ---------------------------------------------------------------------------
# Chapter 3: data parallelism and ZeRO-1 (3 gloo ranks)
# ---------------------------------------------------------------------------

def _flat_buffers(world, n, seed):
    """Every rank's flat gradient buffer (known to all ranks) and the dp-padded length."""
    g = torch.Generator().manual_seed(seed)
    padded = (n + world - 1) // world * world
    bufs = [torch.cat([torch.randn(n, generator=g), torch.zeros(padded - n)]) for _ in range(world)]
    return bufs, padded


def _dp_buckets(rank, world, which):
    from nanohlat import data_parallel, zero1
    group = tp_group(rank, world, "dp")
    op = which.replace("-", "_")
    for n, bucket in ((10, 4), (37, 8), (37, 1000), (6, 3)):    # several buckets, a ragged last one, one bucket
        name = case(f"n={n}, bucket_elems={bucket}")
        bufs, padded = _flat_buffers(world, n, seed=31 + n)
        total = sum(bufs)
        Wire.reset()
        if which == "all-reduce":
            got = data_parallel.all_reduce_buckets(bufs[rank][:n].clone(), group, bucket)
            v = compare(f"{name}: all_reduce_buckets", got, total[:n], rank)
        elif which == "reduce-scatter":
            got = zero1.reduce_scatter_buckets(bufs[rank].clone(), group, bucket)
            v = compare(f"{name}: reduce_scatter_buckets (padded {padded}), this rank's shard",
                        got, total.view(world, -1)[rank], rank)
        else:
            shards = [b.view(world, -1)[r] for r, b in enumerate(bufs)]   # rank r's updated shard
            got = zero1.all_gather_buckets(shards[rank].clone(), group, bucket)
            v = compare(f"{name}: all_gather_buckets (shard of {padded // world})", got, torch.cat(shards), rank)
        if v:
            return v
        # the buckets themselves: how many collectives, each of at most bucket_elems elements
        # (ZeRO-1's: bucket_elems // dp columns of the (dp, S) view, so one call still moves ~bucket_elems)
        columns = n if which == "all-reduce" else padded // world
        per_call = bucket if which == "all-reduce" else max(1, bucket // world)
        sizes = [min(per_call, columns - a) for a in range(0, columns, per_call)]
        rows = 1 if which == "all-reduce" else world        # a ZeRO-1 bucket: those columns of every row
        v = comm_verdict(f"{name}: {which} in buckets", group, [(op, s * rows * 4) for s in sizes], rank)
        if v:
            return v
        calls = len(Wire.calls)
        if calls != len(sizes):
            return (f"{name}: {which} of {columns} columns made {calls} collective call(s) on rank {rank}; expected "
                    f"{len(sizes)}: buckets of {per_call} "
                    + ("elements" if which == "all-reduce" else "columns (bucket_elems // dp) of the (dp, S) view"))
    return None


def check_all_reduce() -> str | None:
    return spawn(_dp_buckets, 3, "all-reduce")   # 3 ranks: uneven shards and padding show


def check_reduce_scatter() -> str | None:
    return spawn(_dp_buckets, 3, "reduce-scatter")   # 3 ranks: uneven shards and padding show


def check_all_gather() -> str | None:
    return spawn(_dp_buckets, 3, "all-gather")   # 3 ranks: uneven shards and padding show


def _zero2_buckets(rank, world):
    """ZeRO-2's reduce_bucket and finish on dp = world and dp = 2 (a group of ranks 0 and 1),
    two micro-batches, the buckets filled last first as a backward fills them, overlap on and off."""
    from types import SimpleNamespace
    from nanohlat.zero2 import ZeroTwoDP
    groups = [tp_group(rank, world, "dp"), tp_group(rank, world, "dp", [0, 1])]
    for group in groups:
        if rank not in group.ranks:
            continue
        dp, me = group.size, group.rank
        for overlap in (False, True):
            for n, bucket in ((10, 2 * dp), (37, 3 * dp), (6, 1000)):   # several buckets, a ragged last one, one
                name = case(f"dp={dp}, overlap {'on' if overlap else 'off'}, n={n}, bucket_elems={bucket}")
                zero = ZeroTwoDP(group, bucket, 2, overlap)
                padded = (n + dp - 1) // dp * dp
                buckets = zero.buckets(padded)
                g = SimpleNamespace(staged={}, flight={}, watch=SimpleNamespace(buckets=buckets),
                                    grad=torch.zeros(padded // dp))
                bufs = [_flat_buffers(dp, n, seed=51 + n + 7 * i)[0] for i in range(2)]   # [micro-batch][rank]
                Wire.reset()
                for i in range(2):
                    for k in reversed(range(len(buckets))):     # a backward completes the last bucket first
                        a, b = buckets[k][0]
                        g.staged[k] = bufs[i][me].view(dp, -1)[:, a:b].reshape(-1).clone()   # the hooks' part
                        zero.reduce_bucket(g, k)
                        if k in g.staged:
                            return (f"{name}: bucket {k}'s staging is still kept after reduce_bucket on rank {rank}: "
                                    f"take it out of g.staged (at the backward's midpoint the stagings are the "
                                    f"whole buffer's 4 bytes per parameter)")
                    if g.flight:
                        return (f"{name}: after micro-batch {i}'s last bucket, bucket(s) {sorted(g.flight)} still in "
                                f"flight on rank {rank}: once the micro-batch started its last bucket, wait for all "
                                f"and add them (no staging kept between micro-batches)")
                for k in sorted(g.flight):
                    zero.finish(g, k)
                want = sum(bufs[i][r].view(dp, -1)[me] for i in range(2) for r in range(dp))
                cols = [b - a for a, b in (bk[0] for bk in buckets)]
                v = (compare(f"{name}: the gradient shard after 2 micro-batches", g.grad, want, rank)
                     or comm_verdict(f"{name}: reduce-scatter of each bucket", group,
                                     [("reduce_scatter", c * dp * 4) for c in cols] * 2, rank))
                if v:
                    return v
                if len(Wire.calls) != 2 * len(buckets):
                    return (f"{name}: {len(Wire.calls)} collective call(s) on rank {rank} for 2 micro-batches of "
                            f"{len(buckets)} bucket(s); expected one reduce-scatter per bucket per micro-batch")
    return None


def check_zero2_bucket() -> str | None:
    return spawn(_zero2_buckets, 3)   # dp 3 and dp 2: uneven shards and padding show


def _zero3_gather_free(rank, world):
    """ZeRO-3's Unit.gather and Unit.free on dp = world and dp = 2: an fp32 and a bf16 flat buffer,
    each with a parameter that is a view of it."""
    from types import SimpleNamespace
    from nanohlat.zero3 import Shard, Unit
    groups = [tp_group(rank, world, "dp"), tp_group(rank, world, "dp", [0, 1])]
    others = [tp_group(rank, world, "dp (a checkpoint's)", g.ranks) for g in groups]   # same ranks, other groups
    g0 = torch.Generator().manual_seed(61)
    for group, other in zip(groups, others):
        if rank not in group.ranks:
            continue
        dp, me, bucket = group.size, group.rank, 2 * group.size
        flats = []
        for n, dtype in ((10, torch.float32), (7, torch.bfloat16)):
            padded = (n + dp - 1) // dp * dp
            flat = torch.randn(padded, generator=g0).to(dtype)
            size = padded // dp
            flats.append(Shard(SimpleNamespace(flat=flat, start=me * size, stop=(me + 1) * size, padded=padded,
                                               grad=None, params=[flat[:4].view(2, 2)]), None))
            flats[-1].want = flat.clone()   # the oracle: every rank's shard, updated alike
        name = case(f"dp={dp}: Unit(...) keeps only the shard")
        unit = Unit(flats, SimpleNamespace(group=group, bucket_elems=bucket))

        def freed(what):
            for g in flats:
                for t, which in ((g.flat, "flat buffer"), (g.params[0], "parameter view")):
                    if t.untyped_storage().nbytes() != 0:
                        return (f"{what}: the {g.flat.dtype} {which}'s storage holds {t.untyped_storage().nbytes()} "
                                f"bytes on rank {rank}; expected 0 (resize the storage to 0: the views stay)")
            return None

        v = freed(name)
        if v:
            return v
        step = 0
        for when, gather_group in (("the first gather", None), ("a gather after free", None),
                                   ("gather(group) with another group given (a checkpoint's load)", other)):
            step += 1
            name = case(f"dp={dp}: {when}")
            for g in flats:                                   # an optimizer step changed every rank's shard
                g.param_shard.add_(step)
                g.want.add_(step)
            Wire.reset()
            unit.gather(gather_group)
            on = gather_group or group
            want_comm = []
            for g in flats:
                want, size = g.want, g.padded * g.flat.element_size()
                if g.flat.untyped_storage().nbytes() != size:
                    return (f"{name}: the {g.flat.dtype} flat buffer's storage holds "
                            f"{g.flat.untyped_storage().nbytes()} bytes on rank {rank} after gather; expected "
                            f"{size} ({g.padded} elements of {g.flat.element_size()} bytes)")
                v = (compare(f"{name}: the {g.flat.dtype} flat buffer", g.flat, want, rank, rtol=0, atol=0)
                     or compare(f"{name}: the {g.flat.dtype} parameter (a view of it)", g.params[0],
                                want[:4].view(2, 2), rank, rtol=0, atol=0))
                if v:
                    return v
                cols = g.padded // dp
                want_comm += [("all_gather", (min(cols, a + max(1, bucket // dp)) - a) * dp * g.flat.element_size())
                              for a in range(0, cols, max(1, bucket // dp))]
            v = comm_verdict(f"{name}: all-gather", on, want_comm, rank)
            if v:
                return v
            name = case(f"dp={dp}: {when}, then gather again (already whole)")
            Wire.reset()
            unit.gather(gather_group)
            v = comm_verdict(name, on, [], rank)
            if v:
                return v
            name = case(f"dp={dp}: {when}, then free")
            unit.free()
            v = freed(name)
            if v:
                return v
    return None


def check_zero3_gather() -> str | None:
    return spawn(_zero3_gather_free, 3)   # dp 3 and dp 2


# ---------------------------------------------------------------------------
# Chapter 7: stochastic rounding
# ---------------------------------------------------------------------------

def _bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and just above each fp32 x, in magnitude (x's sign)."""
    bits = x.view(torch.int32).long() & 0xFFFFFFFF
    down = (bits & 0xFFFF0000).to(torch.int64)
    up = down + 0x10000
    as_float = lambda b: torch.tensor((b - ((b >> 31) << 32)).tolist(), dtype=torch.int32).view(torch.float32)
    return as_float(down), as_float(up)


def _from_bits(bits: list[int]) -> torch.Tensor:
    """fp32 numbers with these 32-bit patterns (0x7FFFFFFF ...)."""
    return torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32).view(torch.float32)


def _unbiased(name: str, rounded: torch.Tensor, value: float) -> str | None:
    mean = rounded.double().mean().item()
    if abs(mean - value) > 4 * 2 ** -7 * 0.5 / rounded.numel() ** 0.5:   # 4 standard errors
        return (f"{name}: rounding {value:.6f} {rounded.numel()} times averages {mean:.6f}: the rounding is "
                f"biased (it must round up with probability (low 16 bits) / 2^16)")
    return None


def check_stochastic_rounding() -> str | None:
    from nanohlat.precision import stochastic_round_to_bf16
    g = torch.Generator().manual_seed(71)
    name = case("given noise: each element rounds up exactly when its low 16 bits + noise carry")
    x = torch.cat([torch.randn(2000, generator=g) * 0.02, torch.randn(2000, generator=g) * 300,
                   torch.tensor([1.0, -1.0, 0.0, 2.0 ** -130, 1 + 2 ** -9, -(1 + 2 ** -9)])])
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=g)
    got = stochastic_round_to_bf16(x, noise=noise)
    if got.dtype != torch.bfloat16:
        return f"{name}: stochastic_round_to_bf16 returned {got.dtype}, expected torch.bfloat16"
    down, up = _bf16_neighbours(x)
    low = x.view(torch.int32).long() & 0xFFFF
    goes_up = low + noise.long() >= 1 << 16          # the carry: probability low / 2^16
    want = torch.where(goes_up, up, down)
    v = compare(f"{name}: stochastic_round_to_bf16(x, noise)", got.float(), want, rtol=0, atol=0)
    if v:
        return v
    # unbiased: the mean over many noise draws of one value approaches the value
    name = case("unbiased with given noise")
    val = torch.full((20000,), 1 + 3 * 2 ** -10)     # 3/8 of the way from 1 to the next bf16 (1 + 2^-7)
    noise = torch.randint(0, 1 << 16, val.shape, dtype=torch.int32, generator=g)
    v = _unbiased(name, stochastic_round_to_bf16(val, noise=noise), val[0].item())
    if v:
        return v
    # NaN has many bit patterns; the noise must not carry a NaN's full mantissa into the sign bit
    # (0x7FFFFFFF + 1 -> 0x80000000, -0.0) nor truncate it to the infinity pattern (0x7F800001 -> inf)
    name = case("odd NaN and infinity bit patterns")
    bits = [0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0xFF800001, 0x7FC00000, 0x7FBFFFFF, 0x7F800000, 0xFF800000]
    special = _from_bits(bits)
    for fill in (1, 0xFFFF, 0x8000, 0):
        out = stochastic_round_to_bf16(special, noise=torch.full((len(bits),), fill, dtype=torch.int32)).float()
        for b, o in zip(bits, out.tolist()):
            is_nan = (b & 0x7F800000) == 0x7F800000 and b & 0x7FFFFF
            ok = o != o if is_nan else o == (float("inf") if b < 1 << 31 else -float("inf"))
            if not ok:
                return (f"{name}: fp32 bits {b:#010x} ({'NaN' if is_nan else 'an infinity'}) with noise {fill:#x} "
                        f"rounded to {o}; NaN must stay NaN and +-inf +-inf, whatever the noise")
    # noise=None: the function draws the noise itself, from `generator`
    name = case("noise drawn by the function (noise=None, a generator)")
    val = torch.full((20000,), 1 + 3 * 2 ** -10)
    first = stochastic_round_to_bf16(val, generator=torch.Generator().manual_seed(5))
    again = stochastic_round_to_bf16(val, generator=torch.Generator().manual_seed(5))
    if first.dtype != torch.bfloat16:
        return f"{name}: returned {first.dtype}, expected torch.bfloat16"
    lo, hi = _bf16_neighbours(val[:1])
    if not ((first.float() == lo) | (first.float() == hi)).all():
        return f"{name}: an element rounded to neither of the two bf16 neighbours {lo.item()} and {hi.item()}"
    if not torch.equal(first, again):
        return (f"{name}: two calls with generators seeded alike rounded differently: draw the noise from "
                f"`generator` (torch.randint(..., generator=generator)), or a run cannot be repeated")
    return _unbiased(name, first, val[0].item())


# ---------------------------------------------------------------------------
# Chapter 8: checkpoints
# ---------------------------------------------------------------------------

def _saved_parts(full: torch.Tensor, tp_dim: int, parts: int, tp: int, optim: bool = False) -> list[dict]:
    """The shards a tp-`tp` run saves of `full`, cut into `parts` along tp_dim (-1:
    replicated); ranks sharing a part (parts < tp) save it once, the first of them."""
    shards = []
    for rank in range(tp):
        copies = tp // parts
        part = rank // copies
        piece = full.chunk(parts, dim=tp_dim)[part] if tp_dim >= 0 else full
        meta = {"w": {"full_shape": list(full.shape), "tp_dim": tp_dim, "parts": parts, "part": part}}
        entry = {}
        if rank % copies == 0:
            n = piece.numel()
            entry = {"w": {"start": 0, "stop": n, "master": piece.reshape(-1).clone(),
                           "exp_avg": piece.reshape(-1) * 2, "exp_avg_sq": piece.reshape(-1) ** 2}} if optim \
                else {"w": piece.clone()}
        shards.append({"tp": tp, "tp_rank": rank, "meta": meta, "model": {} if optim else entry,
                       "optim": entry if optim else {}})
    return shards


def check_reshard() -> str | None:
    from types import SimpleNamespace
    from nanohlat.run.checkpoint import ShardSet
    from nanohlat.config import UserError
    g = torch.Generator().manual_seed(81)
    full = torch.randn(8, 12, generator=g)
    cases = [(0, 2, 2, "split along dim 0 over tp 2 (a column-parallel weight)"),
             (1, 4, 4, "split along dim 1 over tp 4 (a row-parallel weight)"),
             (0, 2, 4, "2 parts held by tp 4, each by 2 ranks (a replicated kv head)"),
             (-1, 1, 2, "replicated over tp 2 (a norm gain)")]
    for tp_dim, parts, tp, what in cases:
        for section in ("model", "optim"):
            case(f"a tensor {what}, section {section!r}")
            shards = _saved_parts(full, tp_dim, parts, tp, optim=section == "optim")
            fake = SimpleNamespace(path="(in memory)", shards={f"shard_{r}.pt": sh for r, sh in enumerate(shards)})
            got = ShardSet.full(fake, "w", section, "master" if section == "optim" else None)
            v = compare(f"a tensor {what}, section {section!r}: ShardSet.full('w', {section!r})", got, full,
                        rtol=0, atol=0)
            if v:
                return v
            if parts > 1:   # a missing shard must be noticed, not silently read as zeros
                fake.shards = {k: sh for k, sh in fake.shards.items() if k != "shard_0.pt"}
                try:
                    ShardSet.full(fake, "w", section, "master" if section == "optim" else None)
                except UserError:
                    continue
                return (f"a tensor {what}, section {section!r}, rank 0's shard missing: ShardSet.full returned a "
                        f"tensor: mark the elements each part covers (cov), so that a gap raises")
    return None


# ---------------------------------------------------------------------------
# Chapter 4: tensor and sequence parallelism (2 gloo ranks)
# ---------------------------------------------------------------------------

TP_WORLD = 4   # chapter 4's checks: at 4 ranks an all-gather + sum costs more than the all-reduce it replaces


def _conjugates(rank, world):
    from nanohlat import tensor_parallel as tpl
    group = tp_group(rank, world)
    g = torch.Generator().manual_seed(41)
    B, T, C = 2, 2 * world, 3
    xs = [torch.randn(B, T, C, generator=g) for _ in range(world)]     # every rank's input, known to all
    gs = [torch.randn(B, T, C, generator=g) for _ in range(world)]     # every rank's upstream gradient
    gs_long = [torch.randn(B, T * world, C, generator=g) for _ in range(world)]
    gs_short = [torch.randn(B, T // world, C, generator=g) for _ in range(world)]
    total_x, total_g = sum(xs), sum(gs)
    full = B * T * C * 4                     # bytes of one (B, T, C) fp32 tensor
    cases = [  # (name, function, upstream grads, forward oracle, backward oracle, forward comm, backward comm)
        ("_Copy (enter, no SP)", tpl._Copy, gs, xs[rank], total_g, [], [("all_reduce", full)]),
        ("_Reduce (leave, no SP)", tpl._Reduce, gs, total_x, gs[rank], [("all_reduce", full)], []),
        ("_GatherSeq (enter, SP)", tpl._GatherSeq, gs_long, torch.cat(xs, dim=1),
         sum(gs_long).chunk(world, dim=1)[rank], [("all_gather", full * world)], [("reduce_scatter", full * world)]),
        ("_ScatterSeq (leave, SP)", tpl._ScatterSeq, gs_short, total_x.chunk(world, dim=1)[rank],
         torch.cat(gs_short, dim=1), [("reduce_scatter", full)], [("all_gather", full)]),
    ]
    for name, fn, grads, want_y, want_grad, fwd_comm, bwd_comm in cases:
        case(name)
        x = xs[rank].clone().requires_grad_()
        Wire.reset()
        y = fn.apply(x, group)
        v = (compare(f"{name} forward", y, want_y, rank)
             or comm_verdict(f"{name} forward", group, fwd_comm, rank))
        if v:
            return v
        Wire.reset()
        y.backward(grads[rank].clone())
        v = (compare(f"{name} backward (gradient of its input)", x.grad, want_grad, rank)
             or comm_verdict(f"{name} backward", group, bwd_comm, rank))
        if v:
            return v
    return None


def check_conjugates() -> str | None:
    return spawn(_conjugates, TP_WORLD)


def _linears(rank, world):
    import torch.nn.functional as F
    from nanohlat import tensor_parallel as tpl
    group = tp_group(rank, world)
    kv_groups = [tp_group(rank, world, "kv", [r, r + 1]) for r in range(0, world, 2)]   # pairs of replicas
    kv = kv_groups[rank // 2]
    g = torch.Generator().manual_seed(42)
    B, T, Cin, Cout = 2, 2 * world, 2 * world, 2 * world
    x, W, G = torch.randn(B, T, Cin, generator=g), torch.randn(Cout, Cin, generator=g), torch.randn(B, T, Cout, generator=g)
    xr, Wr = x.clone().requires_grad_(), W.clone().requires_grad_()
    (F.linear(xr, Wr) * G).sum().backward()
    y_full = F.linear(x, W)
    mine = lambda t, d, parts=world, part=rank: t.chunk(parts, dim=d)[part]
    full = B * T * Cout * 4
    for sp in (False, True):
        sp_txt = " with sequence parallel" if sp else ""
        name = case(f"ColumnParallelLinear{sp_txt}")
        col = tpl.ColumnParallelLinear(Cin, Cout, group)
        with torch.no_grad():
            col.weight.copy_(mine(W, 0))
        xi = (mine(x, 1) if sp else x).clone().requires_grad_()
        entered = tpl.enter(xi, group, sp)              # 4a's part, outside what is measured
        xe = entered.detach().requires_grad_()
        Wire.reset()
        y = col(xe)
        v = (compare(f"{name}: output", y, mine(y_full, 2), rank)
             or comm_verdict(f"{name}: forward", group, [], rank))
        if v:
            return v
        Wire.reset()
        (y * mine(G, 2)).sum().backward()
        moved = comm_verdict(f"{name}: backward", group, [], rank)   # reported once the values are right
        entered.backward(xe.grad)
        v = (compare(f"{name}: weight gradient", col.weight.grad, mine(Wr.grad, 0), rank)
             or compare(f"{name}: gradient of its input, after enter's backward", xi.grad,
                        mine(xr.grad, 1) if sp else xr.grad, rank)
             or moved)
        if v:
            return v
        name = case(f"RowParallelLinear{sp_txt}")
        row = tpl.RowParallelLinear(Cin, Cout, group, sp)
        with torch.no_grad():
            row.weight.copy_(mine(W, 1))
        xi = mine(x, 2).clone().requires_grad_()
        Wire.reset()
        y = row(xi)
        v = (compare(f"{name}: output", y, mine(y_full, 1) if sp else y_full, rank)
             or comm_verdict(f"{name}: forward", group, [("reduce_scatter" if sp else "all_reduce", full)], rank))
        if v:
            return v
        Wire.reset()
        (y * (mine(G, 1) if sp else G)).sum().backward()
        v = (compare(f"{name}: weight gradient", row.weight.grad, mine(Wr.grad, 1), rank)
             or compare(f"{name}: gradient of its input", xi.grad, mine(xr.grad, 2), rank)
             or comm_verdict(f"{name}: backward", group, [("all_gather", full)] if sp else [], rank))
        if v:
            return v
    # tp > n_kv_heads (HLAT-70B: tp 32, 8 kv heads): wk and wv are cut into tp / replicas parts, and
    # the `replicas` neighbouring ranks of a kv group hold the same part; each uses it for its own
    # query heads (its own upstream gradient), the optimizer adds their gradients later
    name = case("kv heads shared by ranks (tp > n_kv_heads): ColumnParallelLinear(replicas=2 ranks)")
    part, parts = rank // kv.size, world // kv.size
    col = tpl.ColumnParallelLinear(Cin, Cout, group, replicas=kv)
    with torch.no_grad():
        col.weight.copy_(mine(W, 0, parts, part))
    Gr = torch.randn(world, B, T, Cout // parts, generator=g)[rank]      # this replica's own upstream gradient
    xi = x.clone().requires_grad_()
    Wire.reset()
    y = col(xi)
    v = compare(f"{name}: output, part {part} of {parts}", y, mine(y_full, 2, parts, part), rank)
    if v:
        return v
    (y * Gr).sum().backward()
    return (compare(f"{name}: weight gradient", col.weight.grad, torch.einsum("bto,bti->oi", Gr, x), rank)
            or compare(f"{name}: gradient of its input", xi.grad, Gr @ mine(W, 0, parts, part), rank)
            or comm_verdict(f"{name}: forward and backward", group, [], rank))


def check_linears() -> str | None:
    return spawn(_linears, TP_WORLD)


def _cross_entropy(rank, world):
    import torch.nn.functional as F
    from nanohlat import tensor_parallel as tpl
    group = tp_group(rank, world)
    g = torch.Generator().manual_seed(43)
    B, T, vocab, padded = 2, 6, 4 * world - 3, 4 * world   # 3 padded entries, all on the last rank
    per = padded // world
    targets = torch.randint(0, vocab, (B, T), generator=g)
    # targets on the first and the last id, and on both sides of every boundary between ranks
    edges = [0, vocab - 1] + [i for r in range(1, world) for i in (r * per - 1, r * per)]
    targets.view(-1)[:len(edges)] = torch.tensor(edges)
    spread = torch.randn(B, T, padded, generator=g) * 4
    big = torch.where(torch.arange(B * T).view(B, T, 1) % 2 == 0, 95.0, -95.0)
    cases = [("logits of about +-8", spread, 50.0),
             # realistic for a large vocabulary late in training, and where exp() overflows fp32 without
             # the max subtraction (e^89 > 3.4e38); the padding above every real logit
             ("large logits (about +-95, padding logits 100)", big + spread, 100.0)]
    BT = B * T * 4
    for name, logits, pad in cases:
        case(name)
        logits = logits.clone()
        logits[..., vocab:] = pad                     # padding must never take probability mass
        ref = logits[..., :vocab].double().requires_grad_()
        want = F.cross_entropy(ref.reshape(-1, vocab), targets.reshape(-1), reduction="none").view(B, T)
        want.sum().backward()
        want_grad = torch.cat([ref.grad, torch.zeros(B, T, padded - vocab, dtype=torch.float64)], dim=-1)
        local = logits.chunk(world, dim=-1)[rank].clone().requires_grad_()
        Wire.reset()
        loss = tpl.vocab_parallel_cross_entropy(local, targets, group, vocab)
        v = (compare(f"{name}: per-token loss", loss, want.detach(), rank)
             or comm_verdict(f"{name}: forward", group,
                             [("all_gather", BT * world), ("all_reduce", BT), ("all_reduce", BT)], rank))
        if v:
            return v
        Wire.reset()
        loss.sum().backward()
        v = (compare(f"{name}: gradient of this rank's logits", local.grad, want_grad.chunk(world, dim=-1)[rank], rank)
             or comm_verdict(f"{name}: backward", group, [], rank))
        if v:
            return v
    return None


def check_cross_entropy() -> str | None:
    return spawn(_cross_entropy, TP_WORLD)


# ---------------------------------------------------------------------------
# Chapter 5: pipeline parallelism
# ---------------------------------------------------------------------------

def oracle_1f1b(pp: int, m: int, stage: int) -> list[tuple[str, int]]:
    """1F1B as the tutorial states it: pp-1-stage warm-up forwards (at most m),
    then alternate one forward, one backward, then the remaining backwards."""
    warm = min(pp - 1 - stage, m)
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    order += [("B", i) for i in range(m - warm, m)]
    return order


def check_1f1b() -> str | None:
    from nanohlat.pipeline import stage_order
    for pp, m in ((2, 1), (2, 4), (4, 4), (4, 8), (4, 2), (8, 3)):
        for stage in range(pp):
            case(f"pp={pp}, m={m}, stage={stage}" + (" (fewer micro-batches than stages)" if m < pp - 1 - stage else ""))
            got = stage_order("1f1b", pp, m, stage)
            want = oracle_1f1b(pp, m, stage)
            if [tuple(op) for op in got] != want:
                fmt = lambda ops: " ".join(f"{k}{i}" for k, i in ops)
                return (f"{_CASE['name']}: stage_order('1f1b', pp={pp}, m={m}, stage={stage}):\n"
                        f"  got      {fmt(got)}\n  expected {fmt(want)}")
    return None


def oracle_interleaved(pp: int, m: int, v: int, stage: int) -> list[tuple[str, int, int]]:
    """Interleaved 1F1B from its definition: the j-th forward of a stage
    takes micro-batch (j // (pp v)) pp + j % pp through chunk (j // pp) % v,
    the j-th backward the same micro-batch through chunk v-1 - (j // pp) % v;
    2(pp-1-stage) + (v-1)pp warm-up forwards (at most v m), then alternate."""
    total = v * m
    fwd = [("F", (j // (pp * v)) * pp + j % pp, (j // pp) % v) for j in range(total)]
    bwd = [("B", (j // (pp * v)) * pp + j % pp, v - 1 - (j // pp) % v) for j in range(total)]
    warm = min(2 * (pp - 1 - stage) + (v - 1) * pp, total)
    order = fwd[:warm]
    for j in range(total - warm):
        order += [fwd[warm + j], bwd[j]]
    return order + bwd[total - warm:]


def check_interleaved() -> str | None:
    from fractions import Fraction as Frac
    from nanohlat.pipeline import interleaved_order, timetable
    fmt = lambda ops: " ".join(f"{k}{i}.{c}" for k, i, c in ops)
    for pp, m, v in ((2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (3, 6, 3), (2, 6, 3)):
        for stage in range(pp):
            case(f"pp={pp}, m={m}, v={v}, stage={stage}")
            got = [tuple(op) for op in interleaved_order(pp, m, v, stage)]
            want = oracle_interleaved(pp, m, v, stage)
            if got != want:
                return (f"{_CASE['name']}: interleaved_order(pp={pp}, m={m}, v={v}, stage={stage}) "
                        f"(op micro-batch.chunk):\n  got      {fmt(got)}\n  expected {fmt(want)}")
        case(f"pp={pp}, m={m}, v={v}: the timetable's bubble")
        ticks = timetable("interleaved", pp, m, v)
        idle = Frac(sum(op is None for row in ticks for op in row), len(ticks) * pp)
        if idle != Frac(pp - 1, v * m + pp - 1):
            return (f"{_CASE['name']}: the stages idle {idle} of the time, where (pp-1)/(v m+pp-1) = "
                    f"{Frac(pp - 1, v * m + pp - 1)}")
    return None


def check_exchange_plan() -> str | None:
    from types import SimpleNamespace
    from nanohlat.pipeline import PipelineRunner, timetable
    for schedule in ("afab", "1f1b"):
        for pp, m in ((2, 3), (4, 4), (4, 6)):
            case(f"{schedule}, pp {pp}, m {m}")
            ticks = timetable(schedule, pp, m)
            runner = SimpleNamespace(ticks=ticks)
            when = {(op[0], s, op[1]): t for t, row in enumerate(ticks) for s, op in enumerate(row) if op}
            for t in range(len(ticks)):
                for b in range(pp - 1):
                    # oracle: after tick t, the activation of F(b, i) crosses b -> b+1 if F(b, i) ran at t,
                    # and the gradient of B(b+1, j) crosses b+1 -> b if B(b+1, j) ran at t
                    act = next((i for i in range(m) if when[("F", b, i)] == t), None)
                    grad = next((j for j in range(m) if when[("B", b + 1, j)] == t), None)
                    got = tuple(PipelineRunner._exchange_plan(runner, t, b))
                    if got != (act, grad):
                        return (f"{schedule}, pp {pp}, m {m}: _exchange_plan(tick {t}, boundary {b}->{b + 1}) = "
                                f"{got} (activation, gradient), expected {(act, grad)}")
    return None


# ---------------------------------------------------------------------------
# Chapter 6: the mesh
# ---------------------------------------------------------------------------

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (4, 2, 3), (2, 3, 4), (8, 4, 2)]


def check_coords() -> str | None:
    from nanohlat.mesh import coords, rank_of
    for tp, pp, dp in LAYOUTS:
        case(f"tp={tp}, pp={pp}, dp={dp}")
        for rank in range(tp * pp * dp):
            want = ((rank // tp) % dp, rank // (tp * dp), rank % tp)   # tp fastest, then dp, then pp
            got = tuple(coords(rank, tp, pp, dp))
            if got != want:
                return (f"tp={tp}, pp={pp}, dp={dp}: coords({rank}, tp={tp}, pp={pp}, dp={dp}) = {got} (dp, pp, tp), "
                        f"expected {want}")
            back = rank_of(*want, tp, dp)
            if back != rank:
                return (f"tp={tp}, pp={pp}, dp={dp}: rank_of(dp={want[0]}, pp={want[1]}, tp={want[2]}, tp={tp}, "
                        f"dp={dp}) = {back}, expected {rank}")
    return None


def check_groups() -> str | None:
    from nanohlat.mesh import Mesh
    for tp, pp, dp in LAYOUTS:
        world = tp * pp * dp
        coord = {r: ((r // tp) % dp, r // (tp * dp), r % tp) for r in range(world)}
        for kind, axis in (("tp", 2), ("dp", 0), ("pp", 1)):
            case(f"tp={tp}, pp={pp}, dp={dp}, the {kind} groups")
            # oracle: ranks that agree on the other two coordinates, sorted
            want = sorted(sorted(r for r in range(world) if all(coord[r][a] == coord[s][a] for a in range(3) if a != axis))
                          for s in range(world))
            want = [list(g) for g in dict.fromkeys(tuple(g) for g in want)]
            got = Mesh(tp, pp, dp, 0)._all(kind)
            if sorted(sorted(g) for g in got) != want:
                return (f"tp={tp}, pp={pp}, dp={dp}, the {kind} groups: Mesh(tp={tp}, pp={pp}, dp={dp})._all({kind!r}) "
                        f"= {got}, expected the groups {want}")
            if any(g != sorted(g) for g in got):
                return (f"tp={tp}, pp={pp}, dp={dp}, the {kind} groups: Mesh(tp={tp}, pp={pp}, dp={dp})._all({kind!r}): "
                        f"list each group's ranks in increasing order")
    return None


CHECKS = {
    "1a": [check_rmsnorm],
    "1b": [check_rotary],
    "1c": [check_kv_cache],
    "3a": [check_all_reduce],
    "3b": [check_reduce_scatter],
    "3c": [check_all_gather],
    "3d": [check_zero2_bucket],
    "3e": [check_zero3_gather],
    "4a": [check_conjugates],
    "4b": [check_linears],
    "4c": [check_cross_entropy],
    "5a": [check_1f1b],
    "5b": [check_exchange_plan],
    "5c": [check_interleaved],
    "6a": [check_coords],
    "6b": [check_groups],
    "7a": [check_stochastic_rounding],
    "8a": [check_reshard],
}
