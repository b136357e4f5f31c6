"""The benches refuse what they cannot measure (issue 63; docs/robustness.md): the cp attention bench's
sizes and round counts, a worker's error ending it at once; the bench's mixture with bias balancing,
which Mixtral cannot express, timed alone with a note.
"""

from __future__ import annotations

import pytest

from hostile import one_line_error


# ---------------------------------------------------------------------------
# The bench: a mixture Mixtral cannot express is timed alone, with a note
# ---------------------------------------------------------------------------

def test_the_bench_times_a_mixture_with_bias_balancing_alone_with_a_note(capsys):
    """`python -m nanohlat.bench --preset moe --moe-bias-rate 1e-3` raised KeyError: 'mlp.expert_bias' in
    serving/hf.py; shared experts and capacity got a one-line note, and so does it now."""
    from nanohlat.bench import bench
    assert bench.main(["--preset", "moe", "--n-layers", "1", "--moe-bias-rate", "1e-3", "--steps", "1",
                       "--warmup", "0", "--threads", "1", "--engines", "eager"]) == 0
    out = capsys.readouterr().out
    assert ("(no Hugging Face model of this shape, timing nanohlat alone: --moe-bias-rate 0.001 moves a bias per "
            "expert after each step, which Mixtral's router has not") in out, out
    assert "hf-mixtral" not in out


# ---------------------------------------------------------------------------
# The cp attention bench: what it cannot measure is refused; a worker's error ends it at once
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--seq-len", "0", "--cp", "2", "--rounds", "1"], "--seq-len must be at least 1, got 0: there would be nothing "
                                                       "to time"),   # both workers raised IndexError; an hour's wait
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),   # a table for 0 sequences, exit 0
    (["--rounds", "0"], "--rounds must be at least 1, got 0"),           # KeyError: 'one process'
    (["--seq-len", "30", "--cp", "2,4"], "--seq-len 30 does not split into 2 x cp = 4 chunks"),
    (["--cp", "1"], "--cp '1': give comma-separated cp sizes of 2 or more"),
    (["--rounds", "x"], "argument --rounds: invalid int value: 'x'"),
])
def test_the_cp_attention_bench_refuses_what_it_cannot_measure(args, message, capsys):
    from nanohlat.bench import cp_attention
    try:
        code = cp_attention.main(args)
    except SystemExit as e:   # (the parser's refusal)
        code = e.code
    assert code == 2
    one_line_error(capsys.readouterr().err, message)


def test_a_cp_attention_workers_error_ends_the_bench_at_once_with_its_line():
    """A worker that raises (here the IndexError that --seq-len 0 caused) ends `run` within seconds with
    that worker's line; the parent waited an hour on its queue while the other worker waited for it."""
    import time
    import torch
    from nanohlat.bench import cp_attention
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^rank \d of the cp 2 workers failed: IndexError: index 0 is out of "
                                           r"bounds for dimension 1 with size 0$"):
        cp_attention.run(2, dict(batch=1, heads=8, kv_heads=4, head_dim=8, seq_len=0, rounds=1, dtype=torch.float32))
    assert time.monotonic() - t0 < 60
