"""--async-save: checkpoints written by a background thread while training goes on.

A synchronous save (saving.save) stops every rank until the slowest has
written its shard and rank 0 has published the manifest. Most of that time
is the write; what must happen at the step's boundary is only the copy of
the state, so that the next steps can change it. So, with --async-save:

  1. at the step's end, on the main thread of every rank: rank 0 makes the
     checkpoint's `.tmp_step_N` folder, a barrier (saving.begin), then the
     snapshot: this rank's shard (weights, optimizer state, the RNG) copied
     to host memory, and rank 0's manifest fields (the step, the tokens, the
     data position, the schedule); the stall a step sees (saving.snapshot);
  2. a writer thread writes the shard with the usual protocol (a temporary
     name, fsync, rename: saving.write_shard), while the main thread trains;
  3. at a later step's end, once every rank's writer is done (the session's
     vote adds one number for it: `writing`), the main thread of every rank
     takes part in the all-gather of the shards' checksums (saving.gather_shards),
     and rank 0's writer thread publishes: the manifest, the rename into
     place, then `latest` (saving.publish). The checkpoint becomes visible
     only then, complete on every rank.

Why the all-gather is on the main thread, never on a writer: gloo runs the
collectives of a process group in the order they are issued, and every rank
must issue the same ones in the same order. A writer that finishes at a
different moment on each rank would slip its collective between different
collectives of the step on each. At a step's end every rank is at the same
place, and the vote tells all of them the same thing.

At most one save is in flight: a save due while the previous one is still
being written waits for it (and says so, once), then starts. The run's end,
a SIGTERM and --stop-after wait for it too (`drain`), then save their last
step synchronously, as without --async-save.

A write that fails in the background (a full disk) fails that save only: its
files are removed, `latest` still names the previous checkpoint, the rank
that could not write says so in one line (`warning: ...`) and training goes
on; the next save tries again. (The run's last save is synchronous: there a
failure ends the run with exit 2, as it does without --async-save.) A kill -9
during a background write leaves a `.tmp_step_N` that nothing reads: the
newest complete checkpoint is the one before, and --resume auto continues
from it.

What it costs: the host memory of one shard per rank, held until it is
written (the plan counts it: plan/failures.py:snapshot_bytes), and the
writer's CPU time and memory bandwidth beside the steps.
"""

from __future__ import annotations

import sys
import threading
import time

import torch

from nanohlat.config import UserError
from nanohlat.run.checkpoint.saving import Snapshot, _abandon, begin, gather_shards, publish, snapshot, write_shard


class BackgroundSaver:
    """One rank's background checkpoints (module docstring). `pending` is the snapshot written, or being
    written, whose shards are not yet gathered; `publishing` rank 0's thread publishing the one before."""

    def __init__(self, mesh, device, say=print):
        self.mesh, self.device, self.say = mesh, device, say
        self.pending: Snapshot | None = None
        self.thread: threading.Thread | None = None
        self.written: tuple | None = None            # (digest, failure) of the pending snapshot's shard
        self.publishing: threading.Thread | None = None
        self.publishing_of = 0                          # its step
        self.publish_error: BaseException | None = None  # a bug in it, raised on the main thread
        self.published: tuple[int, str] | None = None   # (step, path) of the newest checkpoint it published
        self.stalls, self.writes, self.waited, self.failed = [], [], [], 0
        self.said_wait = False

    def writing(self) -> bool:
        """This rank's writer has a shard still to finish (the vote's number)."""
        return self.pending is not None and self.written is None

    def save(self, out_dir: str, step: int, **kwargs) -> None:
        """Every rank, at the end of step `step`: the save in flight, if any, finished first (one at a
        time); then this rank's checkpoint folder and shard snapshot, handed to a writer thread; returns
        while it writes. Keyword arguments: saving.snapshot's. What must come before what (exercise 8b):
          * the save before is gathered and published before this one begins: begin removes the
            `.tmp_` folders it finds, and two saves in flight would hold two snapshots in memory;
          * the folder exists (begin) before a writer writes into it;
          * the snapshot is taken here, on the main thread, before returning: the next step changes
            the tensors it copies, and only the main thread may take part in a collective;
          * the writer gets the snapshot and runs in its own thread: save returns without waiting."""
        t0 = time.perf_counter()
        # exercise 8b: begin
        if self.in_flight() is not None:
            self.wait_for_previous(step)               # written, gathered, published (every rank together)
        begin(out_dir, step, self.mesh, self.device)   # rank 0's .tmp_step_N, then a barrier
        snap = snapshot(out_dir, step, **kwargs)       # this rank's shard, copied to host memory
        if snap is not None:
            self.start_writer(snap)                    # a thread writes it; training goes on
        # exercise 8b: end
        self.stalls.append(time.perf_counter() - t0)

    def in_flight(self) -> int | None:
        """The step of the save before, while it is still being written, gathered or published (else None)."""
        return self.pending.step if self.pending is not None else self.publishing_step()

    def wait_for_previous(self, step: int) -> None:
        """Step `step`'s save waits for the one in flight (said once): its shard written, every rank's
        gathered (a collective), rank 0's publishing done."""
        t0, previous = time.perf_counter(), self.in_flight()
        if not self.said_wait and self.say:
            self.said_wait = True
            self.say(f"note: the checkpoint of step {previous} is still being written at step {step}: "
                     f"step {step}'s save waits for it (--async-save keeps one save in flight; its saves take "
                     f"longer than --save-every's steps)", file=sys.stderr)
        self.finish()
        self._wait_publishing()
        self.waited.append(time.perf_counter() - t0)

    def start_writer(self, snap: Snapshot) -> None:
        """A thread that writes `snap`'s shard (saving.write_shard); `pending` until every rank's is gathered."""
        self.pending, self.written = snap, None
        self.thread = threading.Thread(target=self._write, args=(snap,), daemon=True,
                                       name=f"checkpoint-writer-{snap.step}")
        self.thread.start()

    def _write(self, snap: Snapshot) -> None:
        t0 = time.perf_counter()
        try:
            self.written = write_shard(snap)
        except BaseException as e:   # a bug, not an I/O error (write_shard says those): raised on the main thread
            self.written = (torch.zeros(4, dtype=torch.int64), e)
        self.writes.append(time.perf_counter() - t0)

    def finish(self) -> None:
        """Every rank together (a collective: the main thread, at a step's end): wait for this rank's
        writer, gather the shards' checksums; rank 0 then publishes in its writer thread. A shard
        that could not be written fails this save in one line (by the lowest rank that failed)."""
        snap = self.pending
        if snap is None:
            return
        self.thread.join()
        digest, failure = self.written
        rows = gather_shards(snap, digest, failure, self.mesh, self.device)
        self.pending = self.written = self.thread = None
        failed = [r for r in range(rows.shape[0]) if rows[r, 4]]
        if failed:
            self.failed += 1
            _abandon(snap.tmp, self.mesh)
            if failure is not None and not isinstance(failure, UserError):
                raise failure   # (the writer's bug, here where a traceback reaches the launcher)
            if snap.rank == failed[0]:
                self._warn(snap, failure)
            return
        if snap.rank == 0:
            self.publishing = threading.Thread(target=self._publish, args=(snap, rows), daemon=True,
                                               name=f"checkpoint-publisher-{snap.step}")
            self.publishing_of = snap.step
            self.publishing.start()

    def _publish(self, snap: Snapshot, rows) -> None:
        try:
            failure = publish(snap, rows)
        except BaseException as e:   # a bug, not an I/O error: raised on the main thread (_wait_publishing)
            self.publish_error, failure = e, None
            _abandon(snap.tmp, self.mesh)
            return
        if failure is None:
            self.published = (snap.step, snap.final)
        else:
            self.failed += 1
            _abandon(snap.tmp, self.mesh)
            self._warn(snap, failure)

    def _warn(self, snap: Snapshot, failure) -> None:
        who = f"rank {snap.rank}: " if self.mesh.world > 1 else ""
        print(f"warning: {who}{failure} [step {snap.step}, written in the background: --async-save]; training goes "
              f"on, and the next save tries again", file=sys.stderr, flush=True)

    def publishing_step(self) -> int | None:
        """The step rank 0's publisher is still publishing, if it is (else None)."""
        thread = self.publishing
        return self.publishing_of if thread is not None and thread.is_alive() else None

    def _wait_publishing(self) -> None:
        if self.publishing is not None:
            self.publishing.join()
            self.publishing = None
        if self.publish_error is not None:
            error, self.publish_error = self.publish_error, None
            raise error

    def drain(self) -> tuple[int, str] | None:
        """Every rank together: the save in flight written, gathered and published (the run's end, a
        SIGTERM, --stop-after, --max-bad-steps). Returns (step, path) of the newest checkpoint it published."""
        self.finish()
        self._wait_publishing()
        return self.published

    def summary(self) -> dict:
        """The saves' stalls (the main thread's time at the step's end), write times and waits, in seconds."""
        return {"async_saves": len(self.stalls), "stall_s": self.stalls, "write_s": self.writes,
                "waited_s": self.waited, "failed": self.failed}
