"""The recipe as every command takes it: the core's dataclasses with the fields of beyond/'s extensions,
the presets of both, every check of a value and of a combination of flags, and train.py's flags.

config.py holds the dense HLAT recipe: the model's shape, the run, the presets, each field's meaning
beside it. The extensions in nanohlat/beyond/ add their own fields here (a mixture of experts' shape,
the interleaved schedule's chunks, the expert- and context-parallel degrees), so that every flag is
still a dataclass field and config.json still says everything a run did. Here too, what config.py does
not hold: the checks that a value is in range (`validate`), that flags go together (their refusals,
one line each), that a layout can split the model and the batch (`check_layout`: mesh.py's rules, then
each extension's), and the command line (`parse_args`: one flag per field, `--preset` the start).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, fields

from nanohlat import config
from nanohlat.config import DEVICES, UserError
from nanohlat.beyond.context_parallel import ALGORITHMS as CP_ATTENTIONS   # --cp-attention
from nanohlat.precision import PRECISIONS
from nanohlat.beyond.schedules import SCHEDULES   # --schedule

SEED_LIMIT = 2**63      # --seed: torch's generators take a signed 64-bit seed
MOST = 2**53            # any other count (sizes, steps, ranks): JSON's largest exact integer, as config.json
                        # and a checkpoint record it (checkpoint.read_manifest refuses more)
THREADS_LIMIT = 1024    # --threads: far past any machine's cores (OpenMP crashes at 100,000)


@dataclass
class ModelConfig(config.ModelConfig):
    """config.ModelConfig, the decoder's shape, and a mixture of experts' (moe.py)."""

    # Mixture of experts (moe.py). 0 experts: every block's MLP is dense (all the presets but `moe`)
    moe_experts: int = 0         # E expert MLPs of ffn_dim each in a sparse layer
    moe_top_k: int = 2           # experts each token uses
    moe_shared_experts: int = 0  # experts every token uses besides its k
    moe_every: int = 1           # layer i is sparse when (i + 1) % moe_every == 0 (2: every other layer)
    moe_aux_coef: float = 0.01   # coefficient of the load-balancing loss
    moe_z_coef: float = 0.001    # coefficient of the router z-loss
    moe_bias_rate: float = 0.0   # balancing without a loss (DeepSeek-V3): each step's move of an expert's bias
    moe_capacity_factor: float = 0.0   # 0: dropless; c > 0: each expert takes ceil(c * tokens * k / E)

    def is_moe_layer(self, i: int) -> bool:
        return self.moe_experts > 0 and (i + 1) % self.moe_every == 0

    def sparse_layers(self) -> int:
        """How many layers are sparse (is_moe_layer): the multiples of moe_every up to n_layers, counted
        arithmetically (never layer by layer: a --n-layers of 10^12 is refused by size, not counted)."""
        return self.n_layers // self.moe_every if self.moe_experts > 0 else 0

    def num_params(self) -> int:
        """Parameters of the full (unsharded) model: config.ModelConfig's, and what the sparse layers add."""
        return super().num_params() + self.moe_extra_params()

    def moe_extra_params(self, active: bool = False) -> int:
        """What the sparse layers hold beyond dense ones: each has E + shared experts (active:
        the k + shared a token uses) in the place of one MLP, and the router (E x d_model)."""
        sparse = self.sparse_layers()
        experts = self.moe_top_k if active else self.moe_experts
        return sparse * ((experts + self.moe_shared_experts - 1) * 3 * self.d_model * self.ffn_dim
                         + self.moe_experts * self.d_model)

    def validate(self) -> None:
        check_counts(self)
        for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len",
                     "vocab_multiple"):   # first: the divisibility checks below divide by some of these
            if getattr(self, name) <= 0:
                raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise UserError(f"--d-model {self.d_model} is not divisible by --n-heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise UserError(f"--n-heads {self.n_heads} is not a multiple of --n-kv-heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise UserError(f"head dim {self.head_dim} (d_model / n_heads) must be even for rotary embeddings")
        for name in ("rope_theta", "norm_eps"):
            _finite_in(name, getattr(self, name), 0, math.inf, "> 0", low_open=True)
        if self.moe_experts:
            self.validate_moe()

    def validate_moe(self) -> None:
        if self.moe_experts < 0:
            raise UserError(f"--moe-experts must be >= 0 (0: a dense model), got {self.moe_experts}")
        if not 1 <= self.moe_top_k <= self.moe_experts:
            raise UserError(f"--moe-top-k {self.moe_top_k} must be in [1, --moe-experts {self.moe_experts}]")
        if self.moe_shared_experts < 0 or not 1 <= self.moe_every <= self.n_layers:
            raise UserError(f"--moe-shared-experts must be >= 0 and --moe-every in [1, --n-layers {self.n_layers}], "
                            f"got {self.moe_shared_experts} and {self.moe_every}")
        for name in ("moe_aux_coef", "moe_z_coef", "moe_capacity_factor", "moe_bias_rate"):
            _finite_in(name, getattr(self, name), 0, math.inf, ">= 0")
        most = self.moe_experts / self.moe_top_k   # C = ceil(factor * N * k / E) reaches N there (moe.capacity)
        if self.moe_capacity_factor > most:
            raise UserError(f"--moe-capacity-factor {self.moe_capacity_factor:g} is above --moe-experts / --moe-top-k "
                            f"= {most:g}: at {most:g} each expert already takes every token (capacity C = the "
                            f"tokens, none dropped) and a larger factor only grows its buffer (E x C rows a sparse "
                            f"layer); give at most {most:g}, or 0 (dropless)")


@dataclass
class TrainConfig(config.TrainConfig):
    """config.TrainConfig, the run, and the layouts beyond the core's: the interleaved schedule's chunks,
    expert parallelism, context parallelism (their modules in nanohlat/beyond/)."""

    virtual_stages: int = 1      # interleaved: model chunks per pipeline stage (schedules.py:chunk_layers)
    ep: int = 1                  # expert parallelism: dp ranks sharing a mixture's experts (moe.py)
    cp: int = 1                  # context parallelism: ranks sharing each sequence (context_parallel.py)
    cp_attention: str = "allgather"   # allgather | ring | ulysses: attention across the cp ranks

    def validate(self) -> None:
        check_counts(self)
        for name in ("steps", "batch_size", "seq_len", "microbatches", "nproc", "tp", "pp", "ep", "cp"):
            if getattr(self, name) <= 0:
                raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("save_every", "keep_last", "max_bad_steps", "check_replicas", "eval_every", "eval_batches",
                     "max_restarts", "stop_after", "threads"):
            if getattr(self, name) < 0:
                raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.log_every <= 0:
            raise UserError(f"--log-every must be positive, got {self.log_every}")
        choices = {
            "device": DEVICES,
            "schedule": SCHEDULES,
            "precision": PRECISIONS,
            "moments": ("fp32", "bf16"),
            "activation_checkpointing": ("none", "selective", "full"),
            "cp_attention": CP_ATTENTIONS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise UserError(f"--{name.replace('_', '-')} {getattr(self, name)!r} is not one of {', '.join(allowed)}")
        # Each number against its meaning: NaN fails every comparison, so each
        # check is written as "inside the range", never as "not outside it".
        _finite_in("lr", self.lr, 0, math.inf, "> 0", low_open=True)
        _finite_in("min_lr", self.min_lr, 0, self.lr, "in [0, --lr]")
        _finite_in("beta1", self.beta1, 0, 1, "in [0, 1)", high_open=True)
        _finite_in("beta2", self.beta2, 0, 1, "in [0, 1)", high_open=True)
        _finite_in("adam_eps", self.adam_eps, 0, math.inf, "> 0", low_open=True)
        _finite_in("weight_decay", self.weight_decay, 0, math.inf, ">= 0")
        _finite_in("grad_clip", self.grad_clip, 0, math.inf, ">= 0 (0 = no clipping)")
        _finite_in("bucket_mb", self.bucket_mb, 0, math.inf, "> 0", low_open=True)
        _finite_in("rendezvous_timeout", self.rendezvous_timeout, 0, math.inf, "> 0 seconds", low_open=True)
        _finite_in("collective_timeout", self.collective_timeout, 0, math.inf, "> 0 seconds", low_open=True)
        if self.virtual_stages < 1:
            raise UserError(f"--virtual-stages must be positive, got {self.virtual_stages}")
        if (self.schedule == "interleaved") != (self.virtual_stages > 1):
            raise UserError(f"--schedule {self.schedule} with --virtual-stages {self.virtual_stages}: the interleaved "
                            f"schedule needs --virtual-stages >= 2 (with 1 it is 1f1b), and only it uses them")
        if self.moments == "bf16" and self.precision != "bf16-sr":
            raise UserError(f"--moments bf16 rounds Adam's moments stochastically and needs --precision bf16-sr "
                            f"(got {self.precision}); drop --moments or use --precision bf16-sr")
        if self.zero not in (0, 1, 2, 3):
            raise UserError(f"--zero {self.zero} is not a ZeRO stage; give 0 (none), 1 (optimizer state), "
                            f"2 (+ gradients) or 3 (+ parameters)")
        if self.zero == 3 and self.pp > 1:
            raise UserError(f"--zero 3 with --pp {self.pp} is not supported: a pipeline stage interleaves the "
                            f"forwards and backwards of different micro-batches, which ZeRO-3's per-layer gathers "
                            f"do not follow (zero3.py); use --zero 2 (or --zero 1) with pipeline parallelism")
        if self.zero == 3 and self.compile:
            raise UserError("--zero 3 with --compile is not supported: ZeRO-3 empties and refills the weights' storage "
                            "around every layer, behind the compiled graph's back; drop --compile or use --zero 2")
        if self.zero >= 2 and self.schedule in ("interleaved", "zb-h1"):
            raise UserError(f"--zero {self.zero} with --schedule {self.schedule} is not supported: ZeRO-{self.zero} "
                            f"reduce-scatters a bucket as each micro-batch's backward fills it, and {self.schedule} runs "
                            f"one micro-batch's backward in several ticks between other micro-batches'; use --zero 1")
        if self.schedule == "zb-h1" and self.compile:
            raise UserError("--schedule zb-h1 with --compile is not supported: its split backward hands each linear's "
                            "inputs, in Python, to a later W op, which torch.compile's backward cannot; use 1f1b")
        if self.warmup_steps < 0:
            raise UserError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if self.eval_every and not self.eval_batches:
            raise UserError("--eval-batches 0 with evaluation on would average no batches (val_loss NaN); "
                            "give --eval-batches >= 1, or --eval-every 0 to turn evaluation off")
        if not self.resume.strip():
            raise UserError("--resume is empty; give auto (continue out-dir's run), never (start fresh) "
                            "or a checkpoint path")
        check_seed(self.seed)
        if self.threads > THREADS_LIMIT:
            raise UserError(f"--threads {self.threads} is more than {THREADS_LIMIT}; use at most one per core "
                            f"(0 = this machine's cores shared among the local workers)")


def check_counts(cfg) -> None:
    """Every whole-number field of `cfg` (a ModelConfig or TrainConfig) but --seed at most MOST: a
    size, a step count or a world is checked by arithmetic (divisors, the memory pre-flight), and
    nothing nanohlat records can hold more (a --nproc of 21 digits hung, counting its divisors)."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if type(f.default) is int and f.name != "seed" and isinstance(value, int) and value > MOST:
            raise UserError(f"{_flag(f.name)} {value} is more than 2^53 = {MOST:,}, the largest count nanohlat "
                            f"records exactly (config.json, checkpoints); give a smaller one")


def check_seed(seed: int) -> None:
    """--seed of every command (train, bench, sample, eval, serving)."""
    if not 0 <= seed < SEED_LIMIT:
        raise UserError(f"--seed must be in [0, 2**63), got {seed}")


def _finite_in(name: str, value: float, low: float, high: float, meaning: str,
               low_open: bool = False, high_open: bool = False) -> None:
    """Refuse a flag value that is not a finite number in [low, high] (open ends as told)."""
    ok = (math.isfinite(value) and (value > low if low_open else value >= low)
          and (value < high if high_open else value <= high))
    if not ok:
        raise UserError(f"--{name.replace('_', '-')} must be a finite number {meaning}, got {value}")


# ---------------------------------------------------------------------------
# Presets: config.py's, and the mixtures of experts'
# ---------------------------------------------------------------------------

PRESETS: dict[str, tuple[ModelConfig, dict]] = {
    **{name: (ModelConfig(**dataclasses.asdict(shape)), run) for name, (shape, run) in config.PRESETS.items()},
    # tiny's shape with 4 experts of ffn 128, top-2, in every layer: trains on the CPU (moe.py)
    "moe": (
        ModelConfig(n_layers=4, d_model=64, n_heads=8, n_kv_heads=4, ffn_dim=128,
                    vocab_size=512, max_seq_len=64, moe_experts=4, moe_top_k=2),
        dict(steps=20, batch_size=8, seq_len=32, lr=3e-3, min_lr=3e-4, warmup_steps=5, eval_every=10),
    ),
    # hlat-7b's shape with 8 experts of its MLP in every layer, top-2 (Mixtral's): for --plan (HLAT trained no mixture)
    "hlat-moe": (ModelConfig(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=32, ffn_dim=11008, vocab_size=32000,
                             max_seq_len=4096, moe_experts=8, moe_top_k=2),
                 dict(batch_size=2048, seq_len=4096, lr=3e-4, min_lr=3e-5, warmup_steps=2000, steps=215000)),
}


def divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending, from its prime factors (_factor): never by trying every
    number up to n, which took forever at a world of 10^21 ranks (and up to its square root would
    at 10^30). Sizes reach here checked to be at most MOST (2^53), where it takes milliseconds."""
    out = [1]
    for p, e in sorted(_factor(n).items()):
        out = [d * p ** i for d in out for i in range(e + 1)]
    return sorted(out)


def _factor(n: int) -> dict[int, int]:
    """{prime: exponent} of n: trial division by the small primes, then Pollard's rho (Brent's
    cycle finding) for what is left, each part tested for primality by Miller-Rabin (exact for
    every n below 3.3 x 10^24 with these bases)."""
    found: dict[int, int] = {}
    for p in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):
        while n % p == 0:
            found[p] = found.get(p, 0) + 1
            n //= p
    rest = [n] if n > 1 else []
    while rest:
        m = rest.pop()
        if _is_prime(m):
            found[m] = found.get(m, 0) + 1
        else:
            d = _rho(m)
            rest += [d, m // d]
    return found


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    if n in bases:
        return True
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _rho(n: int) -> int:
    """A factor 1 < d < n of an odd composite n with no factor below 41 (Pollard-Brent)."""
    for c in range(1, n):
        y, m, g, r, q, x = 2, 128, 1, 1, 1, 2
        while g == 1:
            x = y
            for _ in range(r):
                y = (y * y + c) % n
            k = 0
            while k < r and g == 1:
                ys = y
                for _ in range(min(m, r - k)):
                    y = (y * y + c) % n
                    q = q * abs(x - y) % n
                g = math.gcd(q, n)
                k += m
            r *= 2
        if g == n:   # the batch overshot: step one at a time from its start
            g = 1
            while g == 1:
                ys = (ys * ys + c) % n
                g = math.gcd(abs(x - ys), n)
        if g != n:
            return g
    raise AssertionError(f"no factor of {n}")


def choices(xs) -> str:
    """"1, 2 or 4"; a long list (the divisors of a world of 2^53 ranks: thousands) cut to its ends."""
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
    if world > MOST:   # (WORLD_SIZE from a launcher: --nproc is checked with the other counts)
        raise UserError(f"a world of {world} ranks is more than 2^53 = {MOST:,}, the largest count nanohlat "
                        f"records exactly; no machine has as many")
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
    if tcfg.ep > 1 and ((dp * cp) % tcfg.ep or model.moe_experts % tcfg.ep):   # (each ep rank holds E / ep experts)
        where = f"dp x cp {dp * cp}" if cp > 1 else f"dp {dp}"   # (--cp: ep's ranks come out of dp x cp, moe.py)
        raise UserError(f"--ep {tcfg.ep} must divide {where} and --moe-experts {model.moe_experts} (each of the ep "
                        f"ranks holds experts / ep of them); choose among "
                        f"{choices(divisors(math.gcd(dp * cp, model.moe_experts)))}")
    return dp


# ---------------------------------------------------------------------------
# Flags: one per dataclass field, generated so that the two never drift.
# ---------------------------------------------------------------------------

HELP = {
    "preset": "starting values: " + ", ".join(PRESETS),
    "data": "text file, folder of .txt/.py/.md files, or JSONL with a 'text' field ('' = built-in corpus)",
    "tokenizer": "existing SentencePiece tokenizer.model ('' = train one on the corpus and cache it)",
    "batch_size": "global batch in sequences per optimizer step (over all dp ranks)",
    "microbatches": "micro-batches per dp rank per step (gradient accumulation / pipeline depth)",
    "dp": "data-parallel degree (0 = world / (tp * pp))",
    "nproc": "local worker processes train.py starts itself",
    "resume": "auto (continue from out-dir's latest checkpoint), never, or a checkpoint path",
    "stop_after": "stop cleanly after this step, as if interrupted (for resume experiments)",
    "plan": "print the layout, memory, FLOPs, communication and time plan (--cp: its attention too), then exit",
    "search": "with --plan: rank every layout (tp, pp, cp from --seq-len 8192, dp, micro-batches, ZeRO stage, SP, checkpointing; on cpu and "
              "cuda overlapped gradient reduction; a MoE model's --ep) that fits",
    "threads": "CPU threads per worker (0 = cores / local workers)",
    "save_every": "save a checkpoint every N steps (0 = only at the end)",
    "keep_last": "checkpoints to keep (0 = keep all)",
    "max_bad_steps": "stop after this many non-finite steps in a row (0 = never stop)",
    "check_replicas": "every N steps check that all copies of every parameter are bitwise identical, "
                      "stop with an error if not (0 = never)",
    "overwrite": "with --resume never: replace an existing run in --out-dir",
    "allow_tokenizer_change": "resume a checkpoint trained with another tokenizer (its token ids change meaning)",
    "rendezvous_timeout": "seconds every rank waits for the others to join before giving up with an error",
    "collective_timeout": "seconds a collective (all-reduce, send, ...) waits for a stuck or stopped rank before "
                          "the job ends with an error naming it (XLA compiles happen outside collectives)",
    "grad_clip": "clip the global gradient norm to this (0 = no clipping)",
    "sequence_parallel": "Megatron sequence parallelism in the norm/residual regions (needs --tp > 1 to matter)",
    "sp_regather": "with --sequence-parallel: the column-parallel matmuls keep only their 1/tp input shard and "
                   "all-gather it again in backward (Megatron's way; --no-sp-regather keeps the gathered input)",
    "zero": "ZeRO stage over the dp group: 0 (replicated), 1 (shard the master weights and AdamW state), "
            "2 (and the gradients: reduce-scattered in the backward, zero2.py), 3 (and the parameters: "
            "all-gathered per layer in the forward and backward, zero3.py; cpu, cuda; pp 1)",
    "zero1": "the older spelling of --zero 1 (kept)",
    "overlap_grad_reduce": "start each gradient bucket's dp all-reduce / reduce-scatter in the backward, as soon as "
                           "its last gradient is in, and wait for it before the optimizer (bitwise the same; "
                           "cpu and cuda, ignored on xla)",
    "moments": "Adam's two moments in fp32, or bf16 with stochastic rounding (needs --precision bf16-sr; "
               "what HLAT's pure-bf16 stack did: 4 bytes per parameter instead of 8)",
    "compile": "torch.compile the model stage (cpu, cuda; slow first step, see nanohlat/tools/compile.py)",
    "schedule": "pipeline schedule: " + ", ".join(SCHEDULES) + " (pipeline.py)",
    "virtual_stages": "with --schedule interleaved: model chunks per pipeline stage (stage s holds chunks s, s+pp, ...)",
    "moe_experts": "mixture of experts: E expert MLPs in each sparse layer (0 = dense; nanohlat/beyond/moe.py)",
    "moe_top_k": "experts each token is sent to, its router weights renormalised over them (Mixtral)",
    "moe_shared_experts": "experts every token also goes through, besides its top-k (0 = none)",
    "moe_aux_coef": "coefficient of the load-balancing loss E * sum_e f_e * P_e (Switch), "
                    "logged (without it) as moe_balance",
    "moe_z_coef": "coefficient of the router z-loss (ST-MoE: the mean of logsumexp(router "
                  "logits)^2), logged (without it) as moe_z",
    "moe_bias_rate": "balancing without a loss (DeepSeek-V3): a bias per expert, added to the router's "
                     "probabilities to choose the top-k (never to weigh them), moved by this much after each "
                     "step towards the experts the global batch gave less than their share (0 = off; "
                     "DeepSeek-V3: 1e-3; with --moe-aux-coef 0 the only balancing)",
    "ep": "expert parallelism: ranks of each dp group (with --cp: dp x cp) sharing a mixture's experts, E/ep each "
          "(divides dp, or dp x cp; moe.py)",
    "moe_every": "layer i is sparse when (i + 1) %% moe_every == 0 (1: every layer, 2: every other one)",
    "moe_capacity_factor": "0: dropless (every routed token computed); c > 0: each expert takes at most "
                           "ceil(c * tokens * top_k / experts) tokens, the rest dropped (static shapes, for xla)",
    "cp": "context parallelism: split each sequence over N ranks (zigzag: 2N chunks, rank i holds i and 2N-1-i; "
          "--seq-len a multiple of 2N), attention across them by --cp-attention (nanohlat/beyond/context_parallel.py)",
    "cp_attention": "with --cp: " + ", ".join(CP_ATTENTIONS) + " (all-gather K/V; K/V round a ring with an "
                    "online-softmax merge; Ulysses' all-to-all to a head split, needing heads and kv heads "
                    "divisible by --cp)",
    "timeline": "write the last step's pipeline timeline (timeline.txt, and timeline.png with matplotlib)",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser(description: str = "Pre-train a HLAT-style LLaMA model.", cls=argparse.ArgumentParser):
    p = cls(description=description, argument_default=argparse.SUPPRESS)   # cls: system/flags.py's, one-line errors
    for group, cls in (("training", TrainConfig), ("model", ModelConfig)):
        g = p.add_argument_group(group)
        for f in fields(cls):
            kind = type(f.default)
            if kind is bool:
                g.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, help=HELP.get(f.name))
            else:
                g.add_argument(_flag(f.name), type=kind, metavar=f.name.upper(), help=HELP.get(f.name, f"(default {f.default!r})"))
    return p


def resolve(flags: dict) -> tuple[ModelConfig, TrainConfig]:
    """Preset values overlaid with the flags the user actually gave."""
    preset = flags.get("preset", TrainConfig.preset)
    if preset not in PRESETS:
        raise UserError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    base_model, base_train = PRESETS[preset]
    model_names = {f.name for f in fields(ModelConfig)}
    if flags.get("zero1") and flags.get("zero", 1) != 1:
        raise UserError(f"--zero1 is the older spelling of --zero 1 and cannot go with --zero {flags['zero']}; "
                        f"give only --zero {flags['zero']}")
    model_cfg = dataclasses.replace(base_model, **{k: v for k, v in flags.items() if k in model_names})
    tcfg = dataclasses.replace(TrainConfig(), **base_train)
    tcfg = dataclasses.replace(tcfg, **{k: v for k, v in flags.items() if k not in model_names})
    model_cfg.validate()
    tcfg.validate()
    if model_cfg.moe_experts or tcfg.ep > 1:
        check_moe_layout(model_cfg, tcfg)
    if tcfg.cp > 1:
        check_cp_layout(model_cfg, tcfg)
    if tcfg.seq_len > model_cfg.max_seq_len:
        raise UserError(f"--seq-len {tcfg.seq_len} is above the model maximum {model_cfg.max_seq_len}; "
                        f"lower --seq-len or raise --max-seq-len")
    return model_cfg, tcfg


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


def parse_args(argv=None, cls=argparse.ArgumentParser) -> tuple[ModelConfig, TrainConfig]:
    return resolve(vars(build_parser(cls=cls).parse_args(argv)))


def to_dict(model_cfg: ModelConfig, tcfg: TrainConfig) -> dict:
    return {"model": dataclasses.asdict(model_cfg), "train": dataclasses.asdict(tcfg)}


def model_from_dict(d: dict) -> ModelConfig:
    names = {f.name for f in fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in d.items() if k in names})
