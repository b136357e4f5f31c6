"""Chapter 3, data parallelism and ZeRO-1, 2 and 3, on 3 gloo ranks (uneven shards and padding show).

3a (the bucketed all-reduce), 3b (ZeRO-1's reduce-scatter) and 3c (its
all-gather) against the sum of every rank's buffer, known to all ranks, with
one collective per bucket; 3d (ZeRO-2's reduction of one full bucket) on dp 3
and on a dp-2 group, two micro-batches, overlap on and off, its staging freed,
each bucket's reduce-scatter in flight when the hook returns with overlap on
(waited by the micro-batch's last bucket) and done without;
3e (ZeRO-3's gather and free of a unit) on fp32 and bf16 flat buffers: each
gather whole (a second one moves nothing), on another group when given one,
each free down to no storage. Every value, then every collective
(wire.py:comm_verdict).
"""

from __future__ import annotations

import torch

from nanohlat.classroom.checks.grading import case, compare, make_group, spawn
from nanohlat.classroom.checks.wire import Wire, comm_verdict


def _flat_buffers(world, n, seed):
    """Every rank's flat gradient buffer (known to all ranks) and the dp-padded length."""
    g = torch.Generator().manual_seed(seed)
    padded = (n + world - 1) // world * world
    bufs = [torch.cat([torch.randn(n, generator=g), torch.zeros(padded - n)]) for _ in range(world)]
    return bufs, padded


def _dp_buckets(rank, world, which):
    from nanohlat import data_parallel, zero1
    group = make_group(rank, world, "dp")
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


def _in_flight(name, rank, overlap, k, last, started) -> str | None:
    """How bucket k's reduce_bucket ran its collectives (`started`: the calls it started, each
    stamped with when it was waited, if yet). The hook that completes a bucket calls
    reduce_bucket in the middle of the backward: with overlap it must start the reduce-scatter
    (async_op=True: a work handle) and return with it still in flight, so that autograd goes on
    computing the next gradients while it runs; the micro-batch's last bucket waits for them
    all (its own may be blocking: nothing is left to overlap it with). Without overlap each
    bucket is reduced right away."""
    if not started:
        return (f"{name}: reduce_bucket started no collective for bucket {k} on rank {rank}: a full bucket is "
                f"reduce-scattered (with overlap: started) as soon as its hook fills it, not later")
    if not overlap:
        late = [c for c in started if c.waited is None]
        if late:
            return (f"{name}: bucket {k}'s {late[0].kind} was still in flight on rank {rank} when reduce_bucket "
                    f"returned, with overlap off: --no-overlap-grad-reduce reduces each bucket right away "
                    f"(call the blocking collective, or wait for it before returning)")
        return None
    blocking = [c for c in started if not c.async_op]
    if blocking and not last:                  # (the last may as well: nothing is left to overlap it with)
        return (f"{name}: bucket {k}'s {blocking[0].kind} was called blocking on rank {rank} (no async_op=True): "
                f"with --overlap-grad-reduce the hook only starts it (async_op=True, or comm.start_reduce_scatter) "
                f"and keeps the work handle in s.flight, so the backward goes on while it runs; finish waits")
    early = [c for c in started if c.waited is not None]
    if early and not last:
        return (f"{name}: bucket {k}'s {early[0].kind} was started and waited before reduce_bucket returned "
                f"on rank {rank}, with overlap on: the backward then waits for every bucket, as without "
                f"overlap; leave it in flight (s.flight) until the micro-batch's last bucket")
    return None


def _zero2_buckets(rank, world):
    """ZeRO-2's reduce_bucket and finish on dp = world and dp = 2 (a group of ranks 0 and 1),
    two micro-batches, the buckets filled last first as a backward fills them, overlap on and off;
    how each bucket's collective ran: started in flight (overlap) or done (no overlap)."""
    from types import SimpleNamespace
    from nanohlat.beyond.zero2 import ZeroTwoDP
    groups = [make_group(rank, world, "dp"), make_group(rank, world, "dp", [0, 1])]
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
                s = SimpleNamespace(staged={}, flight={}, watch=SimpleNamespace(buckets=buckets),
                                    grad=torch.zeros(padded // dp))
                bufs = [_flat_buffers(dp, n, seed=51 + n + 7 * i)[0] for i in range(2)]   # [micro-batch][rank]
                Wire.reset()
                for i in range(2):
                    first = len(Wire.calls)
                    for k in reversed(range(len(buckets))):     # a backward completes the last bucket first
                        a, b = buckets[k][0]
                        s.staged[k] = bufs[i][me].view(dp, -1)[:, a:b].reshape(-1).clone()   # the hooks' part
                        before = len(Wire.calls)
                        zero.reduce_bucket(s, k)
                        if k in s.staged:
                            return (f"{name}: bucket {k}'s staging is still kept after reduce_bucket on rank {rank}: "
                                    f"take it out of s.staged (at the backward's midpoint the stagings are the "
                                    f"whole buffer's 4 bytes per parameter)")
                        v = _in_flight(name, rank, overlap, k, k == 0, Wire.calls[before:])
                        if v:
                            return v
                    if s.flight:
                        return (f"{name}: after micro-batch {i}'s last bucket, bucket(s) {sorted(s.flight)} still in "
                                f"flight on rank {rank}: once the micro-batch started its last bucket, wait for all "
                                f"and add them (no staging kept between micro-batches)")
                    never = [c for c in Wire.calls[first:] if c.waited is None]
                    if never:
                        return (f"{name}: after micro-batch {i}'s last bucket, {len(never)} of its {never[0].kind}s "
                                f"were never waited on rank {rank} (work.wait()): a started collective's output "
                                f"may not be written yet when it is added")
                for k in sorted(s.flight):
                    zero.finish(s, k)
                want = sum(bufs[i][r].view(dp, -1)[me] for i in range(2) for r in range(dp))
                cols = [b - a for a, b in (bk[0] for bk in buckets)]
                v = (compare(f"{name}: the gradient shard after 2 micro-batches", s.grad, want, rank)
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
    from nanohlat.beyond.zero3 import Shard, Unit
    groups = [make_group(rank, world, "dp"), make_group(rank, world, "dp", [0, 1])]
    others = [make_group(rank, world, "dp (a checkpoint's)", g.ranks) for g in groups]   # same ranks, other groups
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
