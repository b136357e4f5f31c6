"""--timeline with --cp (issue 37): the cp group's collectives of the step, on each cp rank, and each
cp rank's time in attention (tools/comm_trace.py:cp_report, fed by comm.py's `what=` names and
CommTrace.timed). At --cp 2 with each --cp-attention, in 2 gloo workers: every cp rank's rows are the
comm ledger's cp calls and bytes key by key, in the order each algorithm issues them (the ring: per
micro-batch one forward K/V shift per layer, then per layer, last first, a backward K/V shift and two
dK/dV shifts, the second the hop home); every cp rank's attention time is printed, positive, forward
and backward apart; --timeline changes no loss and no byte of the ledger. Negative controls: a
dropped row, two rows swapped, a row's bytes changed each fail the same check.
"""

from __future__ import annotations

import json
import re

import pytest

from conftest import read_metrics
from dist_utils import run_layouts

LAYERS, MICRO = 2, 2
BASE = ["--preset", "tiny", "--n-layers", str(LAYERS), "--steps", "2", "--eval-every", "0", "--batch-size", "4",
        "--seq-len", "32", "--microbatches", str(MICRO), "--check-replicas", "0", "--cp", "2"]
# a row of a cp rank's table: what, collective, bytes, issued, where
ROW = re.compile(r"^  (.{15})  (cp\.\w+)\s+([\d,]+)\s+([\d.]+)\s+(in [FBW]\d+|after the backward|between ops)")
SECTION = re.compile(r"^cp rank (\d+) \(rank (\d+)\): its collectives on the cp group")
ATTENTION = re.compile(r"^\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$")


def expected(algorithm: str, n: int = 2) -> list[tuple[str, str]]:
    """(what, where) of every cp collective of a step on one cp rank, in order (1F1B at pp 1: F0 B0 F1 B1)."""
    fwd, bwd = {"ring": ([f"fwd K/V {s}/{n - 1}" for s in range(1, n)],
                         [x for s in range(1, n + 1) for x in
                          ([f"bwd K/V {s}/{n - 1}"] if s < n else []) + [f"bwd dK/dV {s}/{n}"]]),
                "allgather": (["fwd [K;V]"], ["bwd d[K;V]"]),
                "ulysses": (["fwd qkv>heads", "fwd out>seq"], ["bwd dout>heads", "bwd dqkv>seq"])}[algorithm]
    return [row for mb in range(MICRO) for row in [(w, f"in F{mb}") for _ in range(LAYERS) for w in fwd]
            + [(w, f"in B{mb}") for _ in range(LAYERS) for w in bwd]]


def sections(text: str) -> dict[int, list[tuple]]:
    """{cp rank: its rows (what, collective, bytes, issued, where)} of a timeline.txt."""
    out, rank = {}, None
    for line in text.splitlines():
        if m := SECTION.match(line):
            rank = int(m.group(1))
            out[rank] = []
        elif (m := ROW.match(line)) and rank is not None:
            w, op, b, t, at = m.groups()
            out[rank].append((w.strip(), op, int(b.replace(",", "")), float(t), at))
    return out


def problems(rows, ledger: dict, algorithm: str) -> list[str]:
    """What is wrong with one cp rank's rows against its ledger (summary.json's comm figures)."""
    bad = []
    cp_keys = [k for k in ledger["comm_calls"] if k.startswith("cp.")]
    for key in cp_keys:
        calls = sum(op == key for _, op, *_ in rows)
        nbytes = sum(b for _, op, b, *_ in rows if op == key)
        if (calls, nbytes) != (ledger["comm_calls"][key], ledger["comm_bytes"][key]):
            bad.append(f"{key}: rows {calls} calls, {nbytes:,} bytes; ledger {ledger['comm_calls'][key]}, "
                       f"{ledger['comm_bytes'][key]:,}")
    if len(rows) != sum(ledger["comm_calls"][k] for k in cp_keys):
        bad.append(f"{len(rows)} rows, ledger {sum(ledger['comm_calls'][k] for k in cp_keys)} cp calls")
    if [(w, at) for w, _, _, _, at in rows] != expected(algorithm):
        bad.append(f"order: {[(w, at) for w, *_, at in rows]}")
    if [t for *_, t, _ in rows] != sorted(t for *_, t, _ in rows):
        bad.append("rows not in the order issued")
    return bad


@pytest.fixture(scope="module")
def cp_runs(cache_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("timeline_cp")
    runs = {name: BASE + ["--cp-attention", name.split("_")[0], "--cache-dir", cache_dir, "--out-dir", str(root / name)]
            + ([] if name.endswith("_plain") else ["--timeline"])
            for name in ("ring", "allgather", "ulysses", "ring_plain")}
    run_layouts(2, list(runs.values()), str(root / "errors"))
    return root


def _ledger(out_dir) -> dict:
    with open(out_dir / "summary.json") as f:
        return {k: v for k, v in json.load(f).items() if k.startswith("comm_")}


@pytest.mark.parametrize("algorithm", ["ring", "allgather", "ulysses"])
def test_the_timeline_shows_each_cp_ranks_collectives_as_the_ledger_counts_them(cp_runs, algorithm):
    text = (cp_runs / algorithm / "timeline.txt").read_text()
    ledger = _ledger(cp_runs / algorithm)
    by_rank = sections(text)
    assert sorted(by_rank) == [0, 1], text
    for rank, rows in by_rank.items():
        assert not problems(rows, ledger, algorithm), (rank, problems(rows, ledger, algorithm), text)
        for key in (k for k in ledger["comm_calls"] if k.startswith("cp.")):
            assert re.search(rf"^cp rank {rank}: {re.escape(key)} {ledger['comm_calls'][key]} calls, "
                             rf"{ledger['comm_bytes'][key]:,} bytes", text, re.M), (key, text)
        # negative controls: the same check catches a dropped row, two rows swapped, a row's bytes changed
        assert problems(rows[:-1], ledger, algorithm)
        i = next(i for i in range(len(rows) - 1) if rows[i][0] != rows[i + 1][0])   # two rows of other names
        swapped = rows[:i] + [rows[i + 1][:3] + rows[i][3:], rows[i][:3] + rows[i + 1][3:]] + rows[i + 2:]
        assert problems(swapped, ledger, algorithm)                  # (issue times kept in order)
        assert problems([rows[0][:2] + (rows[0][2] + 4,) + rows[0][3:]] + rows[1:], ledger, algorithm)
    if algorithm == "ring":   # per layer: n-1 = 1 forward shift, n-1 + n = 3 backward ones
        rows = by_rank[0]
        assert sum(w.startswith("fwd") for w, *_ in rows) == LAYERS * MICRO
        assert sum(w.startswith("bwd") for w, *_ in rows) == 3 * LAYERS * MICRO
    # every cp rank's time in attention, forward and backward apart: printed, positive, the calls the layers'
    table = text[text.index("attention on each cp rank"):].splitlines()[2:4]
    times = [ATTENTION.match(line) for line in table]
    assert all(times), table
    for r, m in enumerate(times):
        rank, fc, fw, fb, fo, bc, bw, bb, bo = m.groups()
        assert int(rank) == r and int(fc) == int(bc) == LAYERS * MICRO, table
        assert float(fw) > 0 and float(bw) > 0 and float(fo) > 0 and float(bo) > 0, table
        assert float(fb) <= float(fw) and float(bb) <= float(bw), table
    assert "own work in attention, max/min - 1 across the cp ranks: forward " in text
    assert "not shown" not in text, text                          # pp 1, tp 1: nothing the trace misses


def test_the_cp_timeline_changes_nothing(cp_runs):
    """--timeline's identities and clock reads: the same losses and norms bitwise, the same comm ledger."""
    with_it, without = ([(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(str(cp_runs / n))]
                        for n in ("ring", "ring_plain"))
    assert with_it == without and len(with_it) == 2
    assert _ledger(cp_runs / "ring") == _ledger(cp_runs / "ring_plain")
    assert not (cp_runs / "ring_plain" / "timeline.txt").exists()
