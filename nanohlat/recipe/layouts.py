"""Whether a layout can split the model and the batch (`check_layout`): mesh.py's rules, then each
extension's (experts over --ep, a sequence over --cp). One line each, naming what failed and what to
choose among (`divisors`, `choices`)."""

from __future__ import annotations

import math

from nanohlat.config import UserError
from nanohlat.recipe.configs import MAX_SIZE, ModelConfig, TrainConfig

# --fp8: the length of a block along each matmul's reduction (beyond/fp8_scaling.py: block_sizes, TILE,
# MX_BLOCK; tests/beyond/test_fp8_refusals.py holds them equal); the others' scales run the whole reduction
FP8_REDUCTION_BLOCK = {"blockwise": 128, "mx": 32}

def divisors(n: int) -> list[int]:
    """The divisors of 1 <= n <= MAX_SIZE, ascending: each d up to the square root of n that divides it,
    and n / d (at most 4,096 tries: every size is checked to be at most MAX_SIZE first)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def choices(xs) -> str:
    """"1, 2 or 4"; a long list (the divisors of a large world: hundreds) cut to its ends."""
    xs = list(xs)
    if len(xs) > 12:
        return ", ".join(map(str, xs[:10])) + f", ... or {xs[-1]} ({len(xs):,} in all)"
    return ", ".join(map(str, xs[:-1])) + (" or " if len(xs) > 1 else "") + str(xs[-1])


def check_layout(model: ModelConfig, tcfg: TrainConfig, world: int) -> int:
    """Refuse a layout that cannot work, before any worker starts: the world split into tp x pp (x cp) x dp,
    the model over tp and pp, the batch over dp and the micro-batches; then what the extensions need of
    it. One line each, naming what failed and what to choose. Returns dp."""
    tp, pp, cp = tcfg.tp, tcfg.pp, tcfg.cp
    cp_text = f" x --cp {cp}" if cp > 1 else ""
    if world > MAX_SIZE:   # (WORLD_SIZE from a launcher: --nproc is checked with the other sizes)
        raise UserError(f"a world of {world:,} ranks is more than 2^24 = {MAX_SIZE:,}, the largest world "
                        f"nanohlat takes; no machine has as many")
    if world % (tp * pp * cp):
        raise UserError(f"--tp {tp} x --pp {pp}{cp_text} = {tp * pp * cp} does not divide the world size {world}; "
                        f"choose tp*pp{'*cp' if cp > 1 else ''} among {choices(divisors(world))}")
    dp = tcfg.dp or world // (tp * pp * cp)
    if tp * pp * cp * dp != world:
        raise UserError(f"--tp {tp} x --pp {pp}{cp_text} x --dp {dp} = {tp * pp * cp * dp} but the world has "
                        f"{world} processes; use --dp {world // (tp * pp * cp)} or leave --dp unset")
    if cp > 1:   # (after the world: its sequence's chunks and heads; in resolve too, where the world allows)
        check_cp_layout(model, tcfg)
    # kv heads: each rank holds n_kv_heads/tp of them, or (tp a multiple of
    # n_kv_heads) a replica of one, shared with tp/n_kv_heads ranks
    kv_fits = lambda d: model.n_kv_heads % d == 0 or d % model.n_kv_heads == 0   # noqa: E731
    common = [d for d in divisors(model.n_heads) if kv_fits(d) and model.ffn_dim % d == 0
              and model.padded_vocab % d == 0]
    for what, n in (("n_heads", model.n_heads), ("ffn_dim", model.ffn_dim), ("padded vocabulary", model.padded_vocab)):
        if n % tp:
            hint = (f", or a --vocab-multiple that --tp {tp} divides (the vocabulary is padded up to a "
                    f"multiple of it, now {model.vocab_multiple})") if what == "padded vocabulary" else ""
            raise UserError(f"--tp {tp} does not divide {what} {n}; choose {choices(common)}{hint}")
    if not kv_fits(tp):
        raise UserError(f"--tp {tp} and n_kv_heads {model.n_kv_heads}: one must divide the other (a tp rank holds "
                        f"whole kv heads, or several ranks share one); choose {choices(common)}")
    if pp > model.n_layers or model.n_layers % pp:
        raise UserError(f"--pp {pp} cannot split {model.n_layers} layers into equal contiguous stages; "
                        f"choose {choices(divisors(model.n_layers))}")
    v = tcfg.virtual_stages   # > 1: interleaved (validate checked that the schedule is); the refusal names what failed
    needs = {f"--pp >= 2 (got {pp})": pp >= 2,
             f"--pp x --virtual-stages = {pp * v} chunks of equal size (--n-layers {model.n_layers})": model.n_layers % (pp * v) == 0,
             f"--microbatches {tcfg.microbatches} a multiple of --pp (micro-batches go through the chunks in groups of pp)": tcfg.microbatches % pp == 0}
    if v > 1 and not all(needs.values()):
        raise UserError("--schedule interleaved needs " + "; ".join(need for need, met in needs.items() if not met))
    if tcfg.schedule == "zb-h1" and tcfg.microbatches < pp:
        raise UserError(f"--schedule zb-h1 needs --microbatches >= --pp (got {tcfg.microbatches} < {pp}): W fills "
                        f"the bubble, (p-1)/(3m+p-1), once the pipeline holds a micro-batch per stage")
    per_rank = tcfg.batch_size // dp if tcfg.batch_size % dp == 0 else 0
    if not per_rank or per_rank % tcfg.microbatches:
        raise UserError(f"--batch-size {tcfg.batch_size} must split into dp {dp} x microbatches "
                        f"{tcfg.microbatches} equal micro-batches; use a multiple of {dp * tcfg.microbatches}")
    if tcfg.sequence_parallel and tcfg.seq_len % tp:
        raise UserError(f"--sequence-parallel needs --seq-len {tcfg.seq_len} divisible by --tp {tp}")
    if tcfg.fp8 in FP8_REDUCTION_BLOCK:   # the weight gradient reduces over a micro-batch's tokens (with --cp: all of them)
        check_fp8_reduction(tcfg, "tokens of a micro-batch (--batch-size / dp / --microbatches x --seq-len, each "
                            "weight gradient's reduction)", per_rank // tcfg.microbatches * tcfg.seq_len, "--batch-size")
    if tcfg.ep > 1 and ((dp * cp) % tcfg.ep or model.moe_experts % tcfg.ep):   # (each ep rank holds E / ep experts)
        where = f"dp x cp {dp * cp}" if cp > 1 else f"dp {dp}"   # (--cp: ep's ranks come out of dp x cp, moe.py)
        raise UserError(f"--ep {tcfg.ep} must divide {where} and --moe-experts {model.moe_experts} (each of the ep "
                        f"ranks holds experts / ep of them); choose among "
                        f"{choices(divisors(math.gcd(dp * cp, model.moe_experts)))}")
    return dp


def check_moe_layout(model_cfg: ModelConfig, tcfg: TrainConfig) -> None:
    """A MoE model trains with every layout (experts replicated over dp, cp and tp, or --ep: moe.py,
    any ZeRO, pp with any schedule, cp), and its plan counts every one of them."""
    if tcfg.ep > 1 and not model_cfg.moe_experts:
        raise UserError(f"--ep {tcfg.ep} spreads a mixture's experts over ranks; give --moe-experts too")


def check_cp_layout(model_cfg: ModelConfig, tcfg: TrainConfig) -> None:
    """--cp N: the sequence splits into 2N equal chunks, Ulysses' heads into N.
    When --nproc is not a multiple of tp x pp x cp this waits for check_layout, which says that first."""
    cp = tcfg.cp
    if tcfg.nproc > 1 and tcfg.nproc % (tcfg.tp * tcfg.pp * cp):
        return
    if tcfg.seq_len % (2 * cp):
        raise UserError(f"--cp {cp} splits each sequence into 2 x {cp} = {2 * cp} equal chunks (zigzag): "
                        f"--seq-len {tcfg.seq_len} is not a multiple of {2 * cp}")
    heads, kv_heads = model_cfg.n_heads // tcfg.tp, model_cfg.kv_heads_per_rank(tcfg.tp)   # on one tp rank
    if tcfg.cp_attention == "ulysses" and (heads % cp or kv_heads % cp):
        raise UserError(f"--cp-attention ulysses gives each of the {cp} cp ranks 1/{cp} of a rank's heads: its "
                        f"{heads} heads and {kv_heads} kv heads (n_heads {model_cfg.n_heads}, n_kv_heads "
                        f"{model_cfg.n_kv_heads}, over --tp {tcfg.tp}) must both be divisible by --cp {cp}; "
                        f"use --cp-attention allgather or ring, or another --cp")


def check_fp8_reduction(tcfg: TrainConfig, what: str, size: int, flag: str) -> None:
    """--fp8 blockwise or mx cut each matmul's reduction into blocks: a reduction longer than one block
    must be a whole number of them (one shorter than a block is that block, as if zero-padded: every amax
    and every sum unchanged; the published recipes tile K exactly, and so does a kernel)."""
    block = FP8_REDUCTION_BLOCK[tcfg.fp8]
    if size > block and size % block:
        raise UserError(f"--fp8 {tcfg.fp8} cuts each matmul's reduction into blocks of {block}: the {what} is "
                        f"{size}, longer than one block and not a multiple of {block}; change {flag} to make it "
                        f"one (or at most {block}: one block)")


def check_fp8_recipe(model: ModelConfig, tcfg: TrainConfig) -> None:
    """--fp8 RECIPE (beyond/fp8.py): what it runs with, and the model's reductions under blockwise and mx."""
    refused = {"--compile": tcfg.compile, "--schedule zb-h1": tcfg.schedule == "zb-h1",
               "--moe-capacity-factor": model.moe_experts and model.moe_capacity_factor > 0}
    for flag, given in refused.items():
        if given:
            raise UserError(f"--fp8 with {flag} is not built (its FP8 linears are tested eagerly, with the other "
                            f"schedules, with dropless experts); drop one of the two")
    if tcfg.fp8 not in FP8_REDUCTION_BLOCK:
        return
    split = [f for f, on in (("--sequence-parallel", tcfg.sequence_parallel and tcfg.tp > 1),
                             (f"--cp {tcfg.cp}", tcfg.cp > 1)) if on]
    if model.moe_experts and split:
        raise UserError(f"--fp8 {tcfg.fp8} with a mixture of experts and {' and '.join(split)}: an expert's rows of "
                        f"a micro-batch are then spread over ranks in an order no rank knows, and its tiles along "
                        f"the tokens would straddle them; use --fp8 tensorwise or rowwise, or drop {split[0]}")
    for what, size, flag in (("model width (d_model: the q, k, v, gate and up projections' reduction)",
                              model.d_model, "--d-model"),
                             ("ffn width (the down projection's)", model.ffn_dim, "--ffn-dim"),
                             ("key/value width (n_kv_heads x head dim: wk's and wv's input gradient's)",
                              model.n_kv_heads * model.head_dim, "--n-kv-heads")):
        check_fp8_reduction(tcfg, what, size, flag)
