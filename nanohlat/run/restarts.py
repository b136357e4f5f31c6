"""What failures cost a job the launcher restarted (--max-restarts): the failures, the steps
recomputed, the seconds lost.

After a worker dies (kill -9, a hang ended by --collective-timeout, a crash)
the launcher (train.py --nproc N --max-restarts R, or torchrun's) starts the
group again, and each worker resumes from the newest complete checkpoint
(preflight.worker). What that failure cost is read from the run's own record,
metrics.jsonl, by rank 0 of the restarted job before it cuts the file back to
the checkpoint's step (trainlog.truncate_metrics):

  * the steps recomputed: the last step the failed attempt logged, less the
    checkpoint's step (exact with --log-every 1; with --log-every N the last
    logged step is up to N-1 steps before the failure, and so is the count);
  * the seconds lost: from the moment that last step was logged (the file's
    modification time) to the moment the restarted job logs the same step
    again: finding the failure, starting the workers, loading the checkpoint
    and redoing the work, all of it.

Both go into metrics.jsonl as records of the checkpoint's step (so that a
later resume keeps them): {"step": S, "restart": k, "failed_after_step": L,
"steps_recomputed": L - S} when attempt k starts, and {"step": S,
"recovered": k, "seconds_lost": ...} when it is back at step L. The run's end
sums them (summary.json's "failures", and one printed line). A failure that
struck again before the job was back at its step has no seconds (said as such).
"""

from __future__ import annotations

import json
import os
import time

from nanohlat.run import launch


def last_logged(path: str) -> tuple[int | None, float]:
    """(the last training step metrics.jsonl logged, the file's modification time); (None, 0) without one."""
    if not os.path.isfile(path):
        return None, 0.0
    last = None
    with open(path, "rb") as f:
        for raw in f:
            try:
                record = json.loads(raw.decode())
            except ValueError:
                continue
            step = record.get("step") if isinstance(record, dict) else None
            if "loss" in record and isinstance(step, int) and not isinstance(step, bool):
                last = step if last is None else max(last, step)
    return last, os.path.getmtime(path)


class Restarts:
    """Rank 0's account of this attempt's failure (module docstring). Make it before TrainLog
    opens metrics.jsonl (which cuts it back); `opened`, then `at` after each logged step."""

    def __init__(self, out_dir: str, start_step: int, main: bool):
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.attempt, self.start = launch.restart_count(), start_step
        self.last, self.failed_at, self.log = None, 0.0, None
        if main and self.attempt > 0:
            self.last, self.failed_at = last_logged(self.path)

    def opened(self, log) -> None:
        """TrainLog is open: this attempt's restart record."""
        self.log = log
        if self.last is not None:
            log.record({"step": self.start, "restart": self.attempt, "failed_after_step": self.last,
                        "steps_recomputed": max(0, self.last - self.start)})

    def at(self, step: int) -> None:
        """After step `step`: back at the failed attempt's last step, the seconds it all cost."""
        if self.last is not None and step >= self.last and self.log is not None:
            self.log.record({"step": self.start, "recovered": self.attempt,
                             "seconds_lost": round(time.time() - self.failed_at, 3)})
            self.last = None

    def summary(self) -> dict:
        """From metrics.jsonl (rank 0, at the end): {"restarts", "steps_recomputed", "seconds_lost",
        "not_recovered"}, over every attempt of the job."""
        restarts, recovered = {}, {}
        if os.path.isfile(self.path):
            with open(self.path, "rb") as f:
                for raw in f:
                    try:
                        r = json.loads(raw.decode())
                    except ValueError:
                        continue
                    if isinstance(r, dict) and "restart" in r:
                        restarts[r["restart"]] = r.get("steps_recomputed", 0)
                    if isinstance(r, dict) and "recovered" in r:
                        recovered[r["recovered"]] = r.get("seconds_lost", 0.0)
        return {"restarts": len(restarts), "steps_recomputed": sum(restarts.values()),
                "seconds_lost": round(sum(recovered.values()), 3),
                "not_recovered": len(set(restarts) - set(recovered))}

    @staticmethod
    def line(s: dict) -> str:
        """The run's end: one line, or "" when the job never restarted."""
        if not s["restarts"]:
            return ""
        gap = (f" ({s['not_recovered']} failed again before the job was back at its step: not counted)"
               if s["not_recovered"] else "")
        return (f"failures: {s['restarts']}, each restarted from the newest complete checkpoint: "
                f"{s['steps_recomputed']} steps recomputed, {s['seconds_lost']:.1f} s lost (from each failure's last "
                f"logged step until the job logged it again){gap}")
