"""Context parallelism in the plan (--cp N, context_parallel.py): what each of
the three attention algorithms keeps, sends and computes on one rank.

Each cp rank holds t = T/cp tokens of every sequence, so everything outside
attention (norms, matmuls, the MLP, the loss) is the cp-1 plan at t tokens
(memory.py, communication.py read `local_tokens`). Attention is what differs,
per layer and micro-batch, with e the parameter dtype's bytes, mb sequences,
H query heads and K kv heads on the tp rank, D the head dim, n = cp,
q = mb*t*H*D (this rank's queries: the same count as mb*T*(H/n)*D), kv = mb*t*K*D:

    allgather  keeps q, the whole sequence's K and V (2 e mb*T*K*D: gathered and put
               in position order, kv heads not repeated), the fp32 output (4q) and
               log-sum-exp (4 mb*H*t), the output's copy that wo reads (e q).
               Sends: forward one all-gather of [K; V] (payload e * 2 mb*T*K*D, the
               gathered tensor), backward one reduce-scatter of their gradients
               (the same bytes).
    ring       keeps q, k, v of its own tokens, the fp32 output (4q) and
               log-sum-exp, the output's copy that wo reads (e q): no more
               K/V than its own; and, in every checkpointing mode, its
               (n, t) int64 positions table (8 n t, on the autograd node).
               Sends: forward n-1 ring shifts of [K; V] (e * 2 kv each), backward
               n-1 shifts of [K; V] and n of the fp32 dK/dV travelling with them
               (4 * 2 kv each, the last one the hop home): 3n-2 shifts a layer.
    ulysses    keeps the all-to-all's output in position order (all T tokens, H/n
               heads and K/n kv heads: e (q + 2kv)), the fp32 output (4q, as
               (B, H/n, T, D)) and log-sum-exp (4 mb*(H/n)*T), the output's copy
               that wo reads (e q). Sends: forward two all-to-alls (sequence ->
               heads: e (q + 2kv), heads -> sequence: e q), backward their
               inverses (the same bytes). Needs H and K divisible by n.

No algorithm keeps a mask, the kv heads repeated or a T*T tensor: each computes
its (query chunk, key chunk) pairs with no mask below the causal diagonal, causal
on it and not at all above it, in fp32 (context_parallel.py: the fused CPU kernel,
which returns the log-sum-exp the merge and the backward need, or fp32 matmuls
where torch has no such kernel), and recomputes each pair's scores in backward
from the kept output and log-sum-exp. So the FLOPs of a rank are those of its
causal pairs (below), the same at every cp, and allgather differs from the ring
only in holding the whole sequence's K and V (with grouped-query attention small:
n x its own).

With selective checkpointing all three keep what the cp-1 plan keeps at t
tokens (the attention core is recomputed, its exchanges with it); with full
checkpointing a block keeps its input only. Every mode adds, once per
micro-batch, the rotary angles of this rank's t tokens (cos and sin, fp32,
gathered at their zigzag places). Measured tensor by tensor against autograd
on the CPU, fp32 (tests/plan/test_plan_cp.py).
Checkpointing replays the forward's exchanges in backward: selective and full
once each (ulysses with selective: only the first all-to-all, torch's
checkpoint stops once the attention kernel has what it needs).

Causal work: the token at place p attends to p + 1 keys, so a rank's share of
the attention FLOPs is the sum of (p + 1) over its places. Zigzag (rank i holds
chunks i and 2n-1-i of 2n chunks of c = T/2n) gives every rank
c(2n-1)c + c(c+1) of them, the same; a contiguous split gives rank i
t*i*t + t(t+1)/2, the last rank about 2n-1 times the first's.
"""

from __future__ import annotations

from nanohlat.recipe import ModelConfig, TrainConfig
from nanohlat.recipe.configs import CP_ATTENTIONS as ALGORITHMS   # --cp-attention's values


def local_tokens(tcfg: TrainConfig) -> int:
    """Tokens of each sequence on one rank: T/cp (T at cp 1)."""
    return tcfg.seq_len // tcfg.cp


def _shape(cfg: ModelConfig, mb: int, t: int, tp: int, cp: int):
    H, K = cfg.n_heads // tp, cfg.kv_heads_per_rank(tp)
    return H, K, mb * t * H * cfg.head_dim, mb * t * K * cfg.head_dim


def ulysses_fits(cfg: ModelConfig, tp: int, cp: int) -> bool:
    """Ulysses gives each cp rank 1/cp of the tp rank's heads and kv heads."""
    H, K = cfg.n_heads // tp, cfg.kv_heads_per_rank(tp)
    return H % cp == 0 and K % cp == 0


def attention_core_bytes(cfg: ModelConfig, mb: int, t: int, tp: int, cp: int, itemsize: int, algorithm: str) -> int:
    """What one layer's context-parallel attention keeps for backward, no checkpointing (module docstring);
    replaces memory.layer_activation_bytes' attention core at t = T/cp tokens. The same with or without
    the fused kernel: no algorithm keeps the scores."""
    e = itemsize
    H, K, q, kv = _shape(cfg, mb, t, tp, cp)
    kept = {"allgather": e * q + e * 2 * kv * cp,   # q; the whole sequence's K and V
            "ring": e * (q + 2 * kv),               # q, k, v: its own tokens'
            "ulysses": e * (q + 2 * kv)}            # all T tokens' q, k, v of its H/n and K/n heads
    if algorithm not in kept:
        raise ValueError(f"unknown cp attention {algorithm!r}")
    return kept[algorithm] + 4 * q + 4 * mb * H * t + e * q   # fp32 output, log-sum-exp; wo's copy of the output


def fixed_activation_bytes(cfg: ModelConfig, t: int, cp: int, algorithm: str, layers: int) -> int:
    """What every checkpointing mode keeps per micro-batch beside the layers' activations: the cos and
    sin of this rank's t tokens at their places (fp32, (t, D) each), and with ring each layer's (n, t)
    int64 positions table, an attribute of its autograd node (RingAttention's ctx)."""
    return 2 * 4 * t * cfg.head_dim + (layers * 8 * cp * t if algorithm == "ring" else 0)


def attention_collectives(cfg: ModelConfig, mb: int, t: int, tp: int, cp: int, itemsize: int, algorithm: str,
                          mode: str) -> list[tuple[str, str, int, int]]:
    """(when, collective, payload bytes, calls) per layer and micro-batch on the cp group: when is
    'forward', 'backward' or 'replay' (checkpointing's recompute, in backward)."""
    e, T, n = itemsize, t * cp, cp
    H, K, q, kv = _shape(cfg, mb, t, tp, cp)
    if algorithm == "allgather":
        kv_all = e * 2 * mb * T * K * cfg.head_dim
        out = [("forward", "all_gather", kv_all, 1), ("backward", "reduce_scatter", kv_all, 1)]
        replay = [("replay", "all_gather", kv_all, 1)]
    elif algorithm == "ring":
        out = [("forward", "ring_shift", e * 2 * kv, n - 1), ("backward", "ring_shift", e * 2 * kv, n - 1),
               ("backward", "ring_shift", 4 * 2 * kv, n)]
        replay = [("replay", "ring_shift", e * 2 * kv, n - 1)]
    else:
        there, back = e * (q + 2 * kv), e * q
        out = [("forward", "all_to_all", there, 1), ("forward", "all_to_all", back, 1),
               ("backward", "all_to_all", back, 1), ("backward", "all_to_all", there, 1)]
        replay = [("replay", "all_to_all", there, 1)] + ([("replay", "all_to_all", back, 1)] if mode == "full" else [])
    return out + (replay if mode in ("selective", "full") else [])


def attention_pairs(T: int, cp: int, split: str) -> list[int]:
    """Unmasked (query, key) pairs of causal attention on each cp rank, by the formulas of the module
    docstring: split 'zigzag' (context_parallel.py's) or 'contiguous'."""
    if split == "zigzag":
        c = T // (2 * cp)
        chunk = lambda j: c * j * c + c * (c + 1) // 2     # sum of (p + 1) over chunk j's places
        return [chunk(i) + chunk(2 * cp - 1 - i) for i in range(cp)]
    t = T // cp
    return [t * i * t + t * (t + 1) // 2 for i in range(cp)]


def attention_flops(cfg: ModelConfig, pairs: int, tp: int) -> float:
    """Training FLOPs of causal attention for `pairs` (query, key) pairs, one sequence, one layer,
    one tp rank: QK^T and PV, 2 x 2 x D FLOPs a pair and head forward, twice that backward."""
    return 3 * 4 * cfg.head_dim * (cfg.n_heads // tp) * pairs

