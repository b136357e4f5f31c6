"""The bench's table and its ratios (nanohlat/bench/bench.py prints them): one row per engine and
reference, each engine's tokens/s over its reference's as the median of the rounds' paired
ratios with their middle half, and the machine's load beside them."""

from __future__ import annotations

import statistics

from nanohlat.bench import mixtral
from nanohlat.tools import metrics


def report(times, fwd_bwd, first, compiled, recompiled, tok_per_step, flops_tok, peak, pairs=None) -> str:
    """The table: one row per engine, then the references; `vs ref`: tokens/s relative to the row's
    reference (`pairs`: the compiled engine's is the compiled reference), from the medians."""
    pairs = pairs or {}
    # fwd+bwd and optimizer: medians of each phase (they need not add up to the step's median)
    lines = [f"{'':<18} {'first step':>10} {'median step':>12} {'min':>9} {'max':>9} {'tokens/s':>9} "
             f"{'MFU':>6} {'vs ref':>6} {'graphs':>6} {'recompiled':>10} {'fwd+bwd':>10} {'optimizer':>10}"]
    refs = set(pairs.values())
    for name in sorted(times, key=lambda n: n in refs):   # nanohlat's engines, then Hugging Face's
        ts = times[name]
        med = statistics.median(ts)
        rate = tok_per_step / med
        m = metrics.mfu(rate, flops_tok, peak)
        mfu_text = f"{m * 100:5.1f}%" if m is not None else "   n/a"
        partner = pairs.get(name, name if name in refs else None)
        ratio = f"{statistics.median(times[partner]) / med:5.3f}x" if partner in times else "   n/a"
        g = f"{compiled[name]:>6} {recompiled[name]:>10}" if name in compiled else f"{'-':>6} {'-':>10}"
        phases = ""
        if fwd_bwd[name]:
            fb = statistics.median(fwd_bwd[name])
            op = statistics.median([t - f for t, f in zip(ts, fwd_bwd[name])])
            phases = f" {fb * 1e3:>7.1f} ms {op * 1e3:>7.1f} ms"
        lines.append(f"{name:<18} {first[name]:>8.2f} s {med * 1e3:>9.1f} ms {min(ts) * 1e3:>6.1f} ms "
                     f"{max(ts) * 1e3:>6.1f} ms {rate:>9,.0f} {mfu_text} {ratio} {g}{phases}")
    return "\n".join(lines)


def paired_ratios(times: dict, name: str, ref: str | None = None) -> list[float]:
    """Round by round, the reference's step time over `name`'s: its tokens/s relative to the
    reference's, from the two steps of one round (back to back: main() places each engine next to
    its reference). `ref`: the reference row (default: the eager one)."""
    return [hf / ours for hf, ours in zip(times[ref or reference(times)], times[name])]


def reference(times: dict) -> str | None:
    """The eager Hugging Face row among `times`: hf-llama, or hf-mixtral for a mixture of experts."""
    return next((n for n in ("hf-llama", mixtral.NAME) if n in times), None)


def quartiles(r: list[float]) -> tuple[float, float, float] | None:
    """(25th, 50th, 75th percentile) of the ratios; None for fewer than 4."""
    return tuple(statistics.quantiles(r, n=4)) if len(r) >= 4 else None


def spread(times: dict, names: list, pairs: dict | None = None) -> str:
    """How far the ratio moves from round to round: the median and the middle
    half (25th to 75th percentile) of each engine's paired ratios. When the
    middle half spans a difference (say 1.00x), this run cannot tell the two
    steps apart."""
    pairs = pairs or {}
    lines = ["per-round ratio (each round's step of the reference over the engine's): median, middle half"]
    for name in names:
        r = paired_ratios(times, name, pairs.get(name))
        q = quartiles(r)
        if q is None:
            lines.append(f"  {name:<16} {statistics.median(r):.3f}x   (middle half: needs --steps 4 or more)")
            continue
        lines.append(f"  {name:<16} {q[1]:.3f}x   {q[0]:.3f}x - {q[2]:.3f}x")
    return "\n".join(lines)


def loaded(load: tuple[float, float], cores: int) -> bool:
    """Whether the machine was busier than its cores during the timing: the 1-minute load average
    (os.getloadavg: runnable threads, this bench's own included), before or after, above the core count."""
    return max(load) > cores


def load_line(load: tuple[float, float], cores: int, threads: int | None) -> str:
    """The machine's load around the timing, and whether the ratios below are a result."""
    line = (f"load average (1 min): {load[0]:.2f} before, {load[1]:.2f} after the timing; {cores} cores"
            + (f", this bench's {threads} thread(s)" if threads else ""))
    if loaded(load, cores):
        line += (f"\nnot a result: the load was above the {cores} cores, so other work shared them with the "
                 f"steps; measure again when the machine is quiet")
    return line


def ratio_line(times: dict, name: str, ref: str, what: str = "tokens/s") -> str:
    """`name / ref tokens/s`: the median of the rounds' paired ratios (the reference's time over
    `name`'s: above 1, `name` is faster), its middle half, the rounds. `what`: tokens/s from wall
    times, or (the bench at one thread) the same ratio of CPU times."""
    r = paired_ratios(times, name, ref)
    q = quartiles(r)
    middle = f"middle half {q[0]:.3f}x - {q[2]:.3f}x" if q else "middle half: needs --steps 4 or more"
    label = f"{name} / {ref} {what}" if what == "tokens/s" else f"{ref} / {name} {what}"
    return f"{label}: {statistics.median(r):.3f}x (median of {len(r)} rounds, {middle})"
