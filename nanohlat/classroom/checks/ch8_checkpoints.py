"""Chapter 8, resharding a checkpoint (8a): ShardSet.full rebuilds a full tensor from saved tp parts;
and saving one in the background (8b): BackgroundSaver.save's order of operations.

8a: from shards written here by hand as a tp run saves them: a tensor split along
dimension 0 or 1, two parts held by four ranks (a shared kv head), and a
replicated one, in the model and the optimizer sections, exactly; and a
missing shard noticed (an error), never read as zeros.

8b: with the save protocol's steps (begin, snapshot, write_shard, gather_shards,
publish) replaced by stand-ins that record which thread called them and when
(`_Saves`), two saves in a row, the second due while the first is still being
written: the snapshot taken on the step's thread before save returns, the shard
written by another thread while training would go on, the folder made before
a writer writes, the save in flight written, gathered (on the step's thread: a
collective) and published before the next begins, one writer at a time.
"""

from __future__ import annotations

import torch

from nanohlat.classroom.checks.grading import case, compare


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
# 8b: --async-save's order of operations (run/checkpoint/background.py:BackgroundSaver.save)
# ---------------------------------------------------------------------------

class _Saves:
    """Stand-ins for the save protocol's steps (run/checkpoint/saving.py) that BackgroundSaver calls by name: each
    records (what, step, thread) in `log`; a shard's write waits until the check releases it (at
    most WAIT_S), a publish takes PUBLISH_S, so that what waits for what shows."""

    WAIT_S, PUBLISH_S = 3.0, 0.3

    def __init__(self):
        import threading
        self.log, self.lock, self.writing, self.most_writing = [], threading.Lock(), 0, 0
        self.release = {s: threading.Event() for s in (2, 4, 6)}
        self.started = {s: threading.Event() for s in (2, 4, 6)}
        self.snaps = {}

    def note(self, what: str, step: int) -> None:
        import threading
        with self.lock:
            self.log.append((what, step, threading.get_ident()))

    def begin(self, out_dir, step, mesh, device):
        self.note("begin", step)

    def snapshot(self, out_dir, step, **kwargs):
        from types import SimpleNamespace
        self.note("snapshot", step)
        self.snaps[step] = SimpleNamespace(step=step, rank=0, tmp=f"{out_dir}/.tmp_step_{step}",
                                           final=f"{out_dir}/step_{step}")
        return self.snaps[step]

    def write_shard(self, snap):
        import torch
        with self.lock:
            self.writing += 1
            self.most_writing = max(self.most_writing, self.writing)
        self.note("write", snap.step)
        self.note("write of the snapshot" if snap is self.snaps.get(snap.step) else "write of another object",
                  snap.step)
        self.started[snap.step].set()
        self.release[snap.step].wait(self.WAIT_S)
        with self.lock:
            self.writing -= 1
        self.note("written", snap.step)
        return torch.zeros(4, dtype=torch.int64), None

    def gather_shards(self, snap, digest, failure, mesh, device):
        import torch
        self.note("gather", snap.step)
        return torch.zeros(1, 5, dtype=torch.int64)

    def publish(self, snap, rows):
        import time
        self.note("publish", snap.step)
        time.sleep(self.PUBLISH_S)
        self.note("published", snap.step)
        return None

    def at(self, what: str, step: int) -> int | None:
        return next((i for i, (w, s, _) in enumerate(self.log) if (w, s) == (what, step)), None)

    def thread_of(self, what: str, step: int):
        i = self.at(what, step)
        return None if i is None else self.log[i][2]


def check_background_save() -> str | None:
    import threading
    import time
    from types import SimpleNamespace
    from nanohlat.run.checkpoint import background as bg
    fake = _Saves()
    names = ("begin", "snapshot", "write_shard", "gather_shards", "publish")
    kept = {n: getattr(bg, n) for n in names}
    try:
        for n in names:
            setattr(bg, n, getattr(fake, n))
        saver = bg.BackgroundSaver(SimpleNamespace(rank=0, world=1), None, say=None)
        me = threading.get_ident()
        now = case("a save at the end of step 2: its snapshot taken on the step's thread, its shard written by "
                   "another while save returns")
        t0 = time.perf_counter()
        saver.save("out", 2)
        returned = time.perf_counter() - t0
        fake.started[2].wait(2.0)
        if fake.thread_of("snapshot", 2) != me:
            where = "not at all" if fake.at("snapshot", 2) is None else "on another thread"
            return (f"{now}: the snapshot of step 2 was taken {where}, not on the thread that called save: take "
                    f"it there, before save returns (the next step changes the tensors it copies; only that thread "
                    f"may take part in a collective)")
        if fake.at("write", 2) is None:
            return (f"{now}: no writer wrote step 2's shard (within 2 s of save returning): hand the snapshot to a "
                    f"writer thread")
        if fake.thread_of("write", 2) == me or fake.at("written", 2) is not None and returned >= fake.WAIT_S * 0.8:
            return (f"{now}: step 2's shard was written before save returned (on the thread that called it, or "
                    f"waited for): a save that waits for the disk is a synchronous save; start the writer and return")
        if fake.at("write of the snapshot", 2) is None:
            return f"{now}: the writer of step 2 was not handed the snapshot that snapshot() returned: hand it that"
        if fake.at("begin", 2) is None or fake.at("begin", 2) > fake.at("write", 2):
            return (f"{now}: step 2's writer started before begin made the checkpoint's folder (and every rank "
                    f"passed its barrier): begin first")
        now = case("a save at step 4 while step 2's is still being written: step 2's written, gathered and "
                   "published first, then step 4's begins")
        threading.Timer(0.3, fake.release[2].set).start()
        saver.save("out", 4)
        fake.started[4].wait(2.0)
        b4, g2, p2 = fake.at("begin", 4), fake.at("gather", 2), fake.at("published", 2)
        if b4 is None:
            return f"{now}: step 4's save never began (begin was not called for step 4)"
        if g2 is None or g2 > b4:
            return (f"{now}: step 4's save began before step 2's shards were gathered: finish the save in flight "
                    f"first (wait_for_previous): begin removes the .tmp_ folder step 2's writer is still writing "
                    f"into, and two saves in flight hold two snapshots in memory")
        if p2 is None or p2 > b4:
            return (f"{now}: step 4's save began while rank 0 was still publishing step 2's (its manifest, "
                    f"`latest`): wait for the publisher too (wait_for_previous), one save in flight at a time")
        if fake.thread_of("gather", 2) != me:
            return (f"{now}: step 2's shards were gathered on another thread: the gather is a collective, issued "
                    f"in the same order on every rank only from the thread that runs the steps")
        if fake.most_writing > 1:
            return f"{now}: two shards were being written at once: one save in flight at a time"
        now = case("the save in flight finished at the run's end (drain)")
        fake.release[4].set()
        published = saver.drain()
        if not published or published[0] != 4:
            return f"{now}: after drain the newest published checkpoint is {published}, expected step 4's"
        return None
    finally:
        for n, f in kept.items():
            setattr(bg, n, f)
        for event in fake.release.values():
            event.set()
