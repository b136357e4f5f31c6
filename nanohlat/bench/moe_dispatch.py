"""Benchmark the experts' dispatch: forward + backward time per expert-token as E grows.

    python -m nanohlat.bench.moe_dispatch                  # N 4096, E 8 16 32 64, top-2, C 64, F 128
    python -m nanohlat.bench.moe_dispatch --experts 8,64 --d-model 256 --ffn-dim 512 --threads 2

A mixture's routed work does not depend on E: N tokens, k experts each, are
N * k (token, expert) pairs, the *expert-tokens*, each one SwiGLU of width F,
whatever the number of experts they are spread over. What does grow with E is
the experts' weights (E x 3 x F x C) and their gradients, and the number of
small matmuls. So forward + backward time per expert-token should stay about
flat as E grows at fixed N, k and F; it grows with E when each expert's
backward touches all E experts' weights (indexing a stacked (E, F, C) tensor,
gate[e], gives each expert a gradient the size of the whole stack:
O(E^2 F C) in all; moe.py takes views with unbind instead).

Four dispatches of beyond/moe.py run on the same tokens, routing and weights,
interleaved (each round runs all four, in turn, the order reversed every other
round) so that load from the rest of the machine falls on all alike; the
median round counts:

  sorted     dispatch_sorted, what the model runs: choices sorted by expert, and the
             experts' slices computed as moe.swiglu_slices chooses (where they are small,
             each projection of all of them in one grouped matmul, where torch has one)
  per-slice  dispatch_sorted with one SwiGLU per expert's slice at every size
             (at the defaults the two differ only at E 64: 128 rows an expert is under
             moe.GROUPED_BELOW, 256 and more are not)
  loop       dispatch_loop: the plain reference, each expert finds its tokens
  capacity   dispatch_capacity at factor 1: fixed (E, C, d) queues, one batched matmul
             (it drops what overflows a queue: the same work, not the same result)

and the table prints time per expert-token, the largest over the smallest
across E for each dispatch, and sorted / loop and per-slice / loop at each E. A
benchmark, not a test: it asserts nothing about speed (the sorted, per-slice and
loop outputs are checked equal, to fp32 round-off). The routing is a softmax over random logits: about
N k / E tokens per expert, as a router trained for balance gives.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch

from nanohlat.beyond import moe

DISPATCHES = ("sorted", "per-slice", "loop", "capacity")


def case(n_tokens: int, d_model: int, ffn_dim: int, n_experts: int, k: int, seed: int = 0):
    """(x, experts, weights, gate, up, down): random tokens, a random routing, fp32 experts."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tokens, d_model, generator=g).requires_grad_()
    top_p, experts = torch.randn(n_tokens, n_experts, generator=g).softmax(-1).topk(k, dim=-1)
    weights = top_p / top_p.sum(-1, keepdim=True)
    shapes = ((n_experts, ffn_dim, d_model), (n_experts, ffn_dim, d_model), (n_experts, d_model, ffn_dim))
    params = [(torch.randn(*s, generator=g) * d_model ** -0.5).requires_grad_() for s in shapes]
    return x, experts, weights, *params


@contextlib.contextmanager
def one_matmul_per_slice():
    """moe.swiglu_slices without its grouped matmul: no slice is below GROUPED_BELOW = 0."""
    saved, moe.GROUPED_BELOW = moe.GROUPED_BELOW, 0
    try:
        yield
    finally:
        moe.GROUPED_BELOW = saved


def run(name: str, x, experts, weights, gate, up, down) -> torch.Tensor:
    """One dispatch's output (N, C) (its backward is fixed by the forward's choices)."""
    if name == "sorted":
        return moe.dispatch_sorted(x, experts, weights, gate, up, down)
    if name == "per-slice":
        with one_matmul_per_slice():
            return moe.dispatch_sorted(x, experts, weights, gate, up, down)
    if name == "loop":
        return moe.dispatch_loop(x, experts, weights, gate, up, down)
    return moe.dispatch_capacity(x, experts, weights, gate, up, down, 1.0)[0]


def fwd_bwd(name: str, inputs) -> float:
    """Seconds for one forward + backward of dispatch `name` (the gradients are dropped after)."""
    x, _, _, *params = inputs
    start = time.perf_counter()
    run(name, *inputs).square().sum().backward()
    seconds = time.perf_counter() - start
    for p in (x, *params):
        p.grad = None
    return seconds


def sweep(n_tokens, d_model, ffn_dim, experts_list, k, rounds) -> dict:
    """{E: {dispatch: median seconds}}, each E's dispatches interleaved round by round."""
    out = {}
    for E in experts_list:
        inputs = case(n_tokens, d_model, ffn_dim, E, k)
        with torch.no_grad():   # the three dropless dispatches compute the same thing
            want = run("loop", *inputs)
            for name in ("sorted", "per-slice"):
                assert torch.allclose(run(name, *inputs), want, rtol=1e-5, atol=1e-6), f"E {E}: {name} != loop"
        for name in DISPATCHES:   # one untimed round: first-call allocations
            fwd_bwd(name, inputs)
        times = {name: [] for name in DISPATCHES}
        for i in range(rounds):
            for name in (DISPATCHES if i % 2 == 0 else DISPATCHES[::-1]):
                times[name].append(fwd_bwd(name, inputs))
        out[E] = {name: statistics.median(ts) for name, ts in times.items()}
        print(f"  E {E:>3}: " + ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in out[E].items()), flush=True)
    return out


def report(results: dict, n_tokens: int, k: int) -> str:
    """The table: microseconds per expert-token (median round), then the ratios."""
    pairs = n_tokens * k
    lines = [f"{'E':>4} " + " ".join(f"{n + ' us/pair':>17}" for n in DISPATCHES)
             + f" {'sorted / loop':>14} {'per-slice / loop':>17}"]
    for E, t in results.items():
        lines.append(f"{E:>4} " + " ".join(f"{t[n] / pairs * 1e6:>17.2f}" for n in DISPATCHES)
                     + f" {t['sorted'] / t['loop']:>13.2f}x {t['per-slice'] / t['loop']:>16.2f}x")
    for n in DISPATCHES:
        per = [t[n] for t in results.values()]
        lines.append(f"{n}: largest / smallest time per expert-token over E: {max(per) / min(per):.2f}x")
    for n in ("sorted", "per-slice"):
        slower = [E for E, t in results.items() if t[n] > t["loop"]]
        lines.append(f"{n} at least as fast as loop at every E" if not slower
                     else f"{n} slower than loop at E {', '.join(map(str, slower))}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nanohlat.bench.moe_dispatch",
                                description="Time the experts' dispatch, forward + backward, as E grows.")
    p.add_argument("--tokens", type=int, default=4096, help="N, tokens routed (default 4096)")
    p.add_argument("--experts", default="8,16,32,64", help="comma-separated E values (default 8,16,32,64)")
    p.add_argument("--top-k", type=int, default=2, help="k, experts per token (default 2)")
    p.add_argument("--d-model", type=int, default=64, help="C (default 64)")
    p.add_argument("--ffn-dim", type=int, default=128, help="F, one expert's width (default 128)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per E, the median counts (default 7)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    a = p.parse_args(argv)
    try:
        experts_list = [int(e) for e in a.experts.split(",") if e.strip()]
    except ValueError:
        experts_list = []
    if not experts_list or min(experts_list) < a.top_k or a.top_k < 1:
        print(f"error: --experts must be comma-separated whole numbers, each >= --top-k {a.top_k} >= 1 "
              f"(got {a.experts!r})", file=sys.stderr)
        return 2
    if min(a.tokens, a.d_model, a.ffn_dim, a.rounds, a.threads) < 1:
        print("error: --tokens, --d-model, --ffn-dim, --rounds and --threads must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    print(f"dispatch forward + backward: N {a.tokens} tokens, top-{a.top_k} ({a.tokens * a.top_k} expert-tokens), "
          f"C {a.d_model}, F {a.ffn_dim}, fp32, {a.threads} thread(s); median of {a.rounds} interleaved rounds")
    results = sweep(a.tokens, a.d_model, a.ffn_dim, experts_list, a.top_k, a.rounds)
    print()
    print(report(results, a.tokens, a.top_k))
    return 0


if __name__ == "__main__":
    sys.exit(main())
