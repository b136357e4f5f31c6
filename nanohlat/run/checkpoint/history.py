"""The run's history of checkpoints: which exist, which is the head, which a run starts from.

The newest complete `step_*` directory is the run's head. A run that goes
back to an earlier checkpoint (--resume PATH to step s) moves the checkpoints
after s, and a copy of metrics.jsonl, aside into `checkpoints/abandoned_<time>/`
(and says so) before it trains, so "newest" always means "latest" and nothing
that was trained is deleted. `latest` mirrors the head for people and tools;
the loader relies on the listing, which is right even after a crash between
the rename and the pointer update. A `step_*` folder without its manifest (or
a `.tmp_` one) is incomplete: never loaded, named in a warning, and cleared by
the next save.

Which checkpoint a run starts from (find_resume): --resume auto, the newest
complete one in out-dir (none: a fresh start, refused where out-dir holds a
run's metrics.jsonl records, which it would replace); never, none (an existing run is refused unless
--overwrite, and then cleared by clear_run); PATH, that one. A job restarted
by its launcher after a failure (--max-restarts) continues from the newest
checkpoint it saved, whatever --resume said.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

from nanohlat.config import UserError
from nanohlat.system.files import fsync_dir


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint directory crash-safely: rename it out of sight
    (atomic), then delete. A crash in between leaves only `.trash_` debris.
    A symbolic link there (nanohlat makes none) is removed, never followed."""
    if os.path.islink(path):
        os.unlink(path)
        return
    trash = os.path.join(os.path.dirname(path), ".trash_" + os.path.basename(path))
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def ckpt_root(out_dir: str) -> str:
    return os.path.join(out_dir, "checkpoints")


def step_of(path: str) -> int:
    return int(os.path.basename(os.path.normpath(path))[len("step_"):])


def incomplete_checkpoints(out_dir: str) -> list[str]:
    """`step_*` folders without a manifest and `.tmp_*` folders of unfinished saves."""
    root = ckpt_root(out_dir)
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, n) for n in sorted(os.listdir(root))
            if os.path.isdir(os.path.join(root, n)) and (n.startswith(".tmp_") or (
                n.startswith("step_") and not os.path.isfile(os.path.join(root, n, "manifest.json"))))]


def warn_incomplete(out_dir: str) -> None:
    found = incomplete_checkpoints(out_dir)
    if found:
        print(f"warning: skipping incomplete checkpoint(s) {', '.join(found)} (no manifest: a save that did not "
              f"finish); the next save removes them", file=sys.stderr)


def list_checkpoints(out_dir: str) -> list[str]:
    """Complete checkpoints of a run (they have a manifest), oldest first."""
    root = ckpt_root(out_dir)
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if n.startswith("step_") and n[5:].isdigit()
                   and os.path.isfile(os.path.join(root, n, "manifest.json")))
    return [os.path.join(root, n) for n in names]


def latest(out_dir: str) -> str | None:
    """The run's newest complete checkpoint, or None (see the module docstring)."""
    found = list_checkpoints(out_dir)
    return found[-1] if found else None


def resolve(path: str, say_skipped: bool = False) -> str:
    """A checkpoint directory, or a run directory -> its latest checkpoint.
    `say_skipped`: a newer step_* folder without its manifest (a save that did
    not finish, or damage) is named in one line, not passed over in silence."""
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return path
    found = latest(path) if os.path.isdir(path) else None
    if not found:
        raise UserError(f"no complete checkpoint in {path!r}; train first (python train.py --out-dir {path}) "
                        f"or pass a checkpoint directory")
    newer = [p for p in incomplete_checkpoints(path)
             if os.path.basename(p)[len("step_"):].isdigit() and os.path.basename(p).startswith("step_")
             and step_of(p) > step_of(found)]
    if say_skipped and newer:
        print(f"warning: the newest checkpoint {newer[-1]} has no manifest.json (a save that did not finish, or "
              f"damage): using {found}, the newest complete one", file=sys.stderr)
    return found


def find_resume(out_dir: str, resume: str, overwrite: bool = False, restarted: bool = False) -> str | None:
    """What --resume means for this out-dir: a checkpoint to load, or None to start fresh.

    `restarted`: this process was started again by the launcher after a
    failure (--max-restarts). The job then continues from the newest
    checkpoint it saved in out-dir, whatever --resume said for its first start.
    """
    if restarted:
        return latest(out_dir) or (None if resume in ("auto", "never") else resolve(resume))
    metrics = os.path.join(out_dir, "metrics.jsonl")
    if resume == "auto":
        # nothing to continue from, but a run's records: starting from scratch would replace them
        if not latest(out_dir) and logged_rows(metrics):
            raise UserError(f"--out-dir {out_dir} holds a run's metrics.jsonl ({logged_rows(metrics)} records) but "
                            f"no complete checkpoint to continue from: --resume auto would start from scratch and "
                            f"replace them; --resume never --overwrite starts again, or choose another --out-dir")
        return latest(out_dir)
    if resume == "never":
        # a run that logged no row trained nothing (e.g. one killed with -9 before its first step)
        has_run = latest(out_dir) or (os.path.isfile(metrics) and os.path.getsize(metrics) > 0)
        if has_run and not overwrite:
            raise UserError(f"--out-dir {out_dir} already holds a run; use --resume auto to continue it, "
                            f"--overwrite to replace it, or another --out-dir")
        return None
    return resolve(resume)


def logged_rows(metrics: str) -> int:
    """The records of a run's metrics.jsonl: its lines that are JSON objects with a whole-number step
    (what a resume keeps, trainlog.truncate_metrics: a damaged line, dropped by any resume, is none)."""
    if not os.path.isfile(metrics):
        return 0
    rows = 0
    with open(metrics, "rb") as f:
        for raw in f:
            try:
                record = json.loads(raw.decode())
            except ValueError:      # (not UTF-8, not JSON)
                continue
            step = record.get("step") if isinstance(record, dict) else None
            rows += isinstance(step, int) and not isinstance(step, bool)
    return rows


def clear_run(out_dir: str) -> None:
    """--resume never --overwrite: remove the old run's checkpoints and records
    (only the files a run writes, and eval.py's eval.json and eval_curves.png of
    those checkpoints, which the new run's report.html would otherwise show as
    its own; anything else in out-dir is left alone)."""
    root = ckpt_root(out_dir)
    if os.path.isdir(root):
        for name in os.listdir(root):
            path = os.path.join(root, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            elif name == "latest" or name.endswith(".partial"):
                os.remove(path)
    for name in ("metrics.jsonl", "timeline.txt", "timeline.png", "timeline.json", "summary.json", "config.json",
                 "report.html", "eval.json", "eval_curves.png"):
        if os.path.exists(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))


def set_aside_newer(out_dir: str, step: int) -> str | None:
    """Move the checkpoints of steps >= `step` (and a copy of metrics.jsonl) into
    `checkpoints/abandoned_<time>/`; returns that folder, or None if there were none."""
    newer = [p for p in list_checkpoints(out_dir) if step_of(p) >= step]
    if not newer:
        return None
    aside = os.path.join(ckpt_root(out_dir), time.strftime("abandoned_%Y%m%d-%H%M%S"))
    while os.path.exists(aside):
        aside += "_"
    os.makedirs(aside)
    metrics = os.path.join(out_dir, "metrics.jsonl")
    if os.path.isfile(metrics):
        shutil.copyfile(metrics, os.path.join(aside, "metrics.jsonl"))
    for p in newer:
        os.replace(p, os.path.join(aside, os.path.basename(p)))
    fsync_dir(ckpt_root(out_dir))
    print(f"note: continuing from step {step}: the newer checkpoint(s) "
          f"{', '.join(os.path.basename(p) for p in newer)} and their metrics are kept in {aside} "
          f"(move them back to continue that line instead)", file=sys.stderr)
    return aside
