"""The checks behind `python -m nanohlat.classroom check`: one oracle per exercise.

Every check returns None (pass) or a verdict a student can act on: what was
computed, on which rank, where it first differs from the oracle and by how
much. The oracles are written here, independently of the code they check:
plain dense PyTorch for the parallel layers, hand-derived timetables for the
schedules, exhaustive enumeration for the mesh. A check never compares the
student's code with itself.

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
    return f"raised {type(e).__name__}: {e}{at}"


def run(ex) -> str | None:
    """Run every check of exercise `ex`; the first verdict, or None when all pass."""
    for check in CHECKS[ex.id]:
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


def tp_group(rank: int, world: int):
    """The tensor-parallel group of a plain `world`-rank job, as the model's layers expect it."""
    import torch.distributed as dist
    from nanohlat import comm, mesh
    group_cls = getattr(comm, "Group", None) or mesh.Group
    return group_cls("tp", list(range(world)), rank, dist.group.WORLD)


# ---------------------------------------------------------------------------
# Chapter 1: the transformer
# ---------------------------------------------------------------------------

def check_rmsnorm() -> str | None:
    from nanohlat.model import RMSNorm
    g = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.bfloat16):
        norm = RMSNorm(64, 1e-5, False).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(64, generator=g))
        x = (torch.randn(3, 5, 64, generator=g) * 3 + 0.5).to(dtype)
        x[0, 0] = 1e-4   # a tiny vector: only eps keeps it finite
        y = norm(x)
        x64 = x.double()
        want = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype).double() * norm.weight.double()
        tol = TOL if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        if y.dtype != dtype:
            return f"RMSNorm({dtype}) returned {y.dtype}: the output keeps the input's dtype"
        v = compare(f"RMSNorm output for a {dtype} input", y, want, **tol)
        if v:
            return v
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
    v = compare("apply_rotary(x, *rotary_tables(16, 12, 1e4))", y, want)
    if v:
        return v
    # the property the tutorial promises: <rot(q, m), rot(k, n)> depends on m - n only
    q, k = torch.randn(D, generator=g, dtype=torch.float64), torch.randn(D, generator=g, dtype=torch.float64)
    rq = apply_rotary(q.expand(1, 1, T, D), cos, sin)[0, 0]
    rk = apply_rotary(k.expand(1, 1, T, D), cos, sin)[0, 0]
    return compare("<rot(q, 5), rot(k, 2)> vs <rot(q, 9), rot(k, 6)> (same distance)", rq[5] @ rk[2], rq[9] @ rk[6])


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
                got = gen.cached_forward(model, cache, tokens[:, a:b], torch.arange(a, b).expand(2, b - a))
                v = compare(f"logits of positions {a}..{b - 1} fed with the KV cache holding 0..{a - 1} "
                            f"(n_kv_heads {n_kv})", got, want[:, a:b], rtol=1e-4, atol=1e-5)
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
    from nanohlat import comm, data_parallel, zero1
    group = tp_group(rank, world)
    group.name, group.ledger = "dp", comm.CommLedger()
    for n, bucket in ((10, 4), (37, 8), (37, 1000), (6, 3)):    # several buckets, a ragged last one, one bucket
        bufs, padded = _flat_buffers(world, n, seed=31 + n)
        total = sum(bufs)
        group.ledger.reset()
        if which == "all-reduce":
            got = data_parallel.all_reduce_buckets(bufs[rank][:n].clone(), group, bucket)
            v = compare(f"all_reduce_buckets(n={n}, bucket_elems={bucket})", got, total[:n], rank)
        elif which == "reduce-scatter":
            got = zero1.reduce_scatter_buckets(bufs[rank].clone(), group, bucket)
            v = compare(f"reduce_scatter_buckets(n={n}, padded {padded}, bucket_elems={bucket}): this rank's shard",
                        got, total.view(world, -1)[rank], rank)
        else:
            shards = [b.view(world, -1)[r] for r, b in enumerate(bufs)]   # rank r's updated shard
            got = zero1.all_gather_buckets(shards[rank].clone(), group, bucket)
            v = compare(f"all_gather_buckets(shard of {padded // world}, bucket_elems={bucket})",
                        got, torch.cat(shards), rank)
        if v:
            return v
        # the buckets themselves: how many collectives, each of at most bucket_elems elements
        # (ZeRO-1's: bucket_elems // dp columns of the (dp, S) view, so one call still moves ~bucket_elems)
        op = {"all-reduce": "all_reduce", "reduce-scatter": "reduce_scatter", "all-gather": "all_gather"}[which]
        columns = n if which == "all-reduce" else padded // world
        per_call = bucket if which == "all-reduce" else max(1, bucket // world)
        want_calls = -(-columns // per_call)
        calls = group.ledger.snapshot("calls").get(f"dp.{op}", 0)
        if calls != want_calls:
            return (f"{which} of {columns} columns with bucket_elems={bucket} made {calls} collective call(s) on "
                    f"rank {rank}; expected {want_calls}: buckets of {per_call} "
                    + ("elements" if which == "all-reduce" else "columns (bucket_elems // dp) of the (dp, S) view"))
    return None


def check_all_reduce() -> str | None:
    return spawn(_dp_buckets, 3, "all-reduce")   # 3 ranks: uneven shards and padding show


def check_reduce_scatter() -> str | None:
    return spawn(_dp_buckets, 3, "reduce-scatter")   # 3 ranks: uneven shards and padding show


def check_all_gather() -> str | None:
    return spawn(_dp_buckets, 3, "all-gather")   # 3 ranks: uneven shards and padding show


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


def check_stochastic_rounding() -> str | None:
    from nanohlat.precision import stochastic_round_to_bf16
    g = torch.Generator().manual_seed(71)
    x = torch.cat([torch.randn(2000, generator=g) * 0.02, torch.randn(2000, generator=g) * 300,
                   torch.tensor([1.0, -1.0, 0.0, 2.0 ** -130, 1 + 2 ** -9, -(1 + 2 ** -9)])])
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=g)
    got = stochastic_round_to_bf16(x, noise=noise)
    if got.dtype != torch.bfloat16:
        return f"stochastic_round_to_bf16 returned {got.dtype}, expected torch.bfloat16"
    down, up = _bf16_neighbours(x)
    low = x.view(torch.int32).long() & 0xFFFF
    goes_up = low + noise.long() >= 1 << 16          # the carry: probability low / 2^16
    want = torch.where(goes_up, up, down)
    v = compare("stochastic_round_to_bf16(x, noise): each element rounds up exactly when "
                "its low 16 bits + noise carry", got.float(), want, rtol=0, atol=0)
    if v:
        return v
    # unbiased: the mean over many noise draws of one value approaches the value
    val = torch.full((20000,), 1 + 3 * 2 ** -10)     # 3/8 of the way from 1 to the next bf16 (1 + 2^-7)
    noise = torch.randint(0, 1 << 16, val.shape, dtype=torch.int32, generator=g)
    mean = stochastic_round_to_bf16(val, noise=noise).double().mean()
    if abs(mean.item() - val[0].item()) > 4 * 2 ** -7 * 0.5 / 20000 ** 0.5:   # 4 standard errors
        return (f"rounding 1 + 3/1024 with 20000 random noises averages {mean.item():.6f}, not "
                f"{val[0].item():.6f}: the rounding is biased")
    special = torch.tensor([float("nan"), float("inf"), -float("inf")])
    out = stochastic_round_to_bf16(special, noise=torch.full((3,), (1 << 16) - 1, dtype=torch.int32))
    if not (torch.isnan(out[0]) and out[1] == float("inf") and out[2] == -float("inf")):
        return f"NaN and +-inf must stay NaN and +-inf; got {out.tolist()}"
    return None


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
            shards = _saved_parts(full, tp_dim, parts, tp, optim=section == "optim")
            fake = SimpleNamespace(path="(in memory)", shards={f"shard_{r}.pt": sh for r, sh in enumerate(shards)})
            got = ShardSet.full(fake, "w", section, "master" if section == "optim" else None)
            v = compare(f"ShardSet.full('w', {section!r}) of a tensor {what}", got, full, rtol=0, atol=0)
            if v:
                return v
            if parts > 1:   # a missing shard must be noticed, not silently read as zeros
                fake.shards = {k: sh for k, sh in fake.shards.items() if k != "shard_0.pt"}
                try:
                    ShardSet.full(fake, "w", section, "master" if section == "optim" else None)
                except UserError:
                    continue
                return (f"ShardSet.full('w', {section!r}) of a tensor {what} with rank 0's shard missing returned "
                        f"a tensor: mark the elements each part covers (cov), so that a gap raises")
    return None


# ---------------------------------------------------------------------------
# Chapter 4: tensor and sequence parallelism (2 gloo ranks)
# ---------------------------------------------------------------------------

def _conjugates(rank, world):
    from nanohlat import tensor_parallel as tpl
    group = tp_group(rank, world)
    g = torch.Generator().manual_seed(41)
    xs = [torch.randn(2, 4, 3, generator=g) for _ in range(world)]     # every rank's input, known to all
    gs = [torch.randn(2, 4, 3, generator=g) for _ in range(world)]     # every rank's upstream gradient
    gs_long = [torch.randn(2, 4 * world, 3, generator=g) for _ in range(world)]
    gs_short = [torch.randn(2, 4 // world, 3, generator=g) for _ in range(world)]
    total_x, total_g = sum(xs), sum(gs)
    cases = [  # (name, function, upstream grads, forward oracle, backward oracle)
        ("_Copy (enter, no SP)", tpl._Copy, gs, xs[rank], total_g),
        ("_Reduce (leave, no SP)", tpl._Reduce, gs, total_x, gs[rank]),
        ("_GatherSeq (enter, SP)", tpl._GatherSeq, gs_long, torch.cat(xs, dim=1),
         sum(gs_long).chunk(world, dim=1)[rank]),
        ("_ScatterSeq (leave, SP)", tpl._ScatterSeq, gs_short, total_x.chunk(world, dim=1)[rank],
         torch.cat(gs_short, dim=1)),
    ]
    for name, fn, grads, want_y, want_grad in cases:
        x = xs[rank].clone().requires_grad_()
        y = fn.apply(x, group)
        v = compare(f"{name} forward", y, want_y, rank)
        if v:
            return v
        y.backward(grads[rank])
        v = compare(f"{name} backward (gradient of its input)", x.grad, want_grad, rank)
        if v:
            return v
    return None


def check_conjugates() -> str | None:
    return spawn(_conjugates, 2)


def _linears(rank, world):
    import torch.nn.functional as F
    from nanohlat import tensor_parallel as tpl
    group = tp_group(rank, world)
    g = torch.Generator().manual_seed(42)
    B, T, Cin, Cout = 2, 4, 6, 8
    x, W, G = torch.randn(B, T, Cin, generator=g), torch.randn(Cout, Cin, generator=g), torch.randn(B, T, Cout, generator=g)
    xr, Wr = x.clone().requires_grad_(), W.clone().requires_grad_()
    (F.linear(xr, Wr) * G).sum().backward()
    y_full = F.linear(x, W)
    mine = lambda t, d: t.chunk(world, dim=d)[rank]
    for sp in (False, True):
        sp_txt = " with sequence parallel" if sp else ""
        col = tpl.ColumnParallelLinear(Cin, Cout, group)
        with torch.no_grad():
            col.weight.copy_(mine(W, 0))
        xi = (mine(x, 1) if sp else x).clone().requires_grad_()
        y = col(tpl.enter(xi, group, sp))
        v = compare(f"ColumnParallelLinear output{sp_txt}", y, mine(y_full, 2), rank)
        if v:
            return v
        (y * mine(G, 2)).sum().backward()
        v = (compare(f"ColumnParallelLinear weight gradient{sp_txt}", col.weight.grad, mine(Wr.grad, 0), rank)
             or compare(f"gradient of the column-parallel input{sp_txt}", xi.grad,
                        mine(xr.grad, 1) if sp else xr.grad, rank))
        if v:
            return v
        row = tpl.RowParallelLinear(Cin, Cout, group, sp)
        with torch.no_grad():
            row.weight.copy_(mine(W, 1))
        xi = mine(x, 2).clone().requires_grad_()
        y = row(xi)
        v = compare(f"RowParallelLinear output{sp_txt}", y, mine(y_full, 1) if sp else y_full, rank)
        if v:
            return v
        (y * (mine(G, 1) if sp else G)).sum().backward()
        v = (compare(f"RowParallelLinear weight gradient{sp_txt}", row.weight.grad, mine(Wr.grad, 1), rank)
             or compare(f"gradient of the row-parallel input{sp_txt}", xi.grad, mine(xr.grad, 2), rank))
        if v:
            return v
    return None


def check_linears() -> str | None:
    return spawn(_linears, 2)


def _cross_entropy(rank, world):
    import torch.nn.functional as F
    from nanohlat import tensor_parallel as tpl
    group = tp_group(rank, world)
    g = torch.Generator().manual_seed(43)
    B, T, vocab, padded = 2, 5, 13, 16            # 3 padded entries, all on the last rank
    logits = torch.randn(B, T, padded, generator=g) * 4
    logits[..., vocab:] = 50.0                    # padding must never take probability mass
    targets = torch.randint(0, vocab, (B, T), generator=g)
    targets[0, 0], targets[1, 1] = 0, vocab - 1   # targets on the first and the last rank
    ref = logits[..., :vocab].clone().requires_grad_()
    want = F.cross_entropy(ref.reshape(-1, vocab), targets.reshape(-1), reduction="none").view(B, T)
    want.sum().backward()
    want_grad = torch.cat([ref.grad, torch.zeros(B, T, padded - vocab)], dim=-1)
    local = logits.chunk(world, dim=-1)[rank].clone().requires_grad_()
    loss = tpl.vocab_parallel_cross_entropy(local, targets, group, vocab)
    v = compare("per-token loss", loss, want.detach(), rank)
    if v:
        return v
    loss.sum().backward()
    return compare("gradient of this rank's logits", local.grad, want_grad.chunk(world, dim=-1)[rank], rank)


def check_cross_entropy() -> str | None:
    return spawn(_cross_entropy, 2)


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
            got = stage_order("1f1b", pp, m, stage)
            want = oracle_1f1b(pp, m, stage)
            if [tuple(op) for op in got] != want:
                fmt = lambda ops: " ".join(f"{k}{i}" for k, i in ops)
                return (f"stage_order('1f1b', pp={pp}, m={m}, stage={stage}):\n"
                        f"  got      {fmt(got)}\n  expected {fmt(want)}")
    return None


def check_exchange_plan() -> str | None:
    from types import SimpleNamespace
    from nanohlat.pipeline import PipelineRunner, timetable
    for schedule in ("afab", "1f1b"):
        for pp, m in ((2, 3), (4, 4), (4, 6)):
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
                        return (f"_exchange_plan(tick {t}, boundary {b}->{b + 1}) with {schedule}, pp {pp}, "
                                f"m {m} = {got} (activation, gradient), expected {(act, grad)}")
    return None


# ---------------------------------------------------------------------------
# Chapter 6: the mesh
# ---------------------------------------------------------------------------

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (4, 2, 3), (2, 3, 4), (8, 4, 2)]


def check_coords() -> str | None:
    from nanohlat.mesh import coords, rank_of
    for tp, pp, dp in LAYOUTS:
        for rank in range(tp * pp * dp):
            want = ((rank // tp) % dp, rank // (tp * dp), rank % tp)   # tp fastest, then dp, then pp
            got = tuple(coords(rank, tp, pp, dp))
            if got != want:
                return f"coords({rank}, tp={tp}, pp={pp}, dp={dp}) = {got} (dp, pp, tp), expected {want}"
            back = rank_of(*want, tp, dp)
            if back != rank:
                return f"rank_of(dp={want[0]}, pp={want[1]}, tp={want[2]}, tp={tp}, dp={dp}) = {back}, expected {rank}"
    return None


def check_groups() -> str | None:
    from nanohlat.mesh import Mesh
    for tp, pp, dp in LAYOUTS:
        world = tp * pp * dp
        coord = {r: ((r // tp) % dp, r // (tp * dp), r % tp) for r in range(world)}
        for kind, axis in (("tp", 2), ("dp", 0), ("pp", 1)):
            # oracle: ranks that agree on the other two coordinates, sorted
            want = sorted(sorted(r for r in range(world) if all(coord[r][a] == coord[s][a] for a in range(3) if a != axis))
                          for s in range(world))
            want = [list(g) for g in dict.fromkeys(tuple(g) for g in want)]
            got = Mesh(tp, pp, dp, 0)._all(kind)
            if sorted(sorted(g) for g in got) != want:
                return f"Mesh(tp={tp}, pp={pp}, dp={dp})._all({kind!r}) = {got}, expected the groups {want}"
            if any(g != sorted(g) for g in got):
                return f"Mesh(tp={tp}, pp={pp}, dp={dp})._all({kind!r}): list each group's ranks in increasing order"
    return None


CHECKS = {
    "1a": [check_rmsnorm],
    "1b": [check_rotary],
    "1c": [check_kv_cache],
    "3a": [check_all_reduce],
    "3b": [check_reduce_scatter],
    "3c": [check_all_gather],
    "4a": [check_conjugates],
    "4b": [check_linears],
    "4c": [check_cross_entropy],
    "5a": [check_1f1b],
    "5b": [check_exchange_plan],
    "6a": [check_coords],
    "6b": [check_groups],
    "7a": [check_stochastic_rounding],
    "8a": [check_reshard],
}
