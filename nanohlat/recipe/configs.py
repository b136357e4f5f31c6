"""The recipe's fields: the core's dataclasses (config.py) with the fields of beyond/'s extensions, each
value's check, and the presets of both.

config.py holds the dense HLAT recipe: the model's shape, the run, the presets, each field's meaning
beside it. The extensions in nanohlat/beyond/ add their own fields here (a mixture of experts' shape,
the interleaved schedule's chunks, the expert- and context-parallel degrees), so that every flag is
still a dataclass field and config.json still says everything a run did. `validate` checks that each
value is in range and that flags go together (their refusals, one line each).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields

from nanohlat import config
from nanohlat.config import DEVICES, UserError
from nanohlat.precision import PRECISIONS

# The values of --schedule and --cp-attention, named here so that reading the flags loads no extension
# (a run of HLAT's recipe never imports nanohlat/beyond/): the core's two schedules (pipeline.py) and
# beyond/schedules.py's two; beyond/context_parallel.py's three algorithms. tests/run/test_core_runs_alone.py
# holds both tuples to those modules.
SCHEDULES = ("afab", "1f1b", "interleaved", "zb-h1")
CP_ATTENTIONS = ("allgather", "ring", "ulysses")
# --fp8's recipes (beyond/fp8_scaling.py: RECIPES, held to this by tests/beyond/test_fp8_refusals.py) and the
# gradients' formats; "none" trains without FP8
FP8_RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise", "mx")
FP8_GRAD_FORMATS = ("e5m2", "e4m3")
FP8_MARGIN_MOST = 64   # --fp8-margin: scale / 2^margin; past 64 every scale of a finite amax is below 2^-48

SEED_LIMIT = 2**63      # --seed: torch's generators take a signed 64-bit seed
MAX_SIZE = 2**24        # any size: a dimension, a batch, a degree, a world of ranks (16,777,216: far past any
                        # cluster and model); the layouts' divisors are tried up to its square root, 4,096
SIZES = ("batch_size", "seq_len", "microbatches", "nproc", "tp", "pp", "dp", "ep", "cp", "virtual_stages")
MOST = 2**53            # any other count (steps, intervals): JSON's largest exact integer, as config.json
                        # and a checkpoint record it (checkpoint.read_manifest refuses more)
THREADS_LIMIT = 1024    # --threads: far past any machine's cores (OpenMP crashes at 100,000)
# --moe-aux-coef, --moe-z-coef: a router loss's weight beside the language model's loss (a few units). Past 10^6
# the language model's share of the gradients they both reach is below fp32's round-off of the sum (~1e-7);
# far past it the product overflows (1e308, 1e40: "cannot be converted to type float without overflow")
COEF_MOST = 1e6
FP32_MOST = 3.4028234663852886e38   # the largest fp32 (and bf16) number: a float flag the arithmetic uses stays below
# the largest value of each float flag, and why (the smallest, and NaN and inf, are validate's _finite_in):
HIGHEST = {
    "lr": (FP32_MOST, "fp32's largest number; the arithmetic is fp32, or bf16 of the same range"),
    "weight_decay": (FP32_MOST, "fp32's largest number"),
    "grad_clip": (FP32_MOST, "fp32's largest number (0 turns clipping off)"),
    "adam_eps": (1.0, "eps guards Adam's division by sqrt(v) against 0: from 1 up it outweighs sqrt(v) of every "
                      "gradient below 1 and the update shrinks to m / eps (HLAT: 1e-8)"),
    "bucket_mb": (1e9, "a petabyte, more than any model's gradients (one bucket then holds them all)"),
    # RMSNorm divides by sqrt(mean square + eps): above 1, eps outweighs the mean square of any activation of unit
    # scale and the norm stops normalising (at 1e308 every block's input was ~0 and the loss stayed at ln V)
    "norm_eps": (1.0, "above 1 it outweighs the mean square RMSNorm divides by, which then normalises nothing"),
    "moe_aux_coef": (COEF_MOST, "a router loss's weight beside the language model's loss (a few units): past 1e6 "
                                "the language model's share of the gradients is below fp32's round-off"),
    "moe_z_coef": (COEF_MOST, "a router loss's weight beside the language model's loss (a few units): past 1e6 "
                              "the language model's share of the gradients is below fp32's round-off"),
    # each step moves an expert's bias by this much, beside router probabilities in [0, 1]: a move of 1 already
    # outweighs any of them (1e39 overflowed fp32 at the first step: every bias NaN, routing collapsed)
    "moe_bias_rate": (1.0, "a bias's move per step beside router probabilities in [0, 1]: 1 already outweighs "
                           "any of them (DeepSeek-V3: 1e-3)"),
    # failures at scale (plan/failures.py, run/stragglers.py): past these the figures they make mean nothing
    "mtbf_hours": (1e9, "a node failing once in 100,000 years never fails in a run: the interval outgrows any run"),
    "storage_gb_s": (1e9, "an exabyte a second, past any storage: a save then takes no time"),
    "straggler_factor": (1e6, "a rank a million times slower than the others has stopped: --collective-timeout's "
                              "to end"),
}
SAVE_EVERY_AUTO = -1    # --save-every auto, until the pre-flight makes it Young/Daly's interval (plan/failures.py)
# One node's mean time between failures, from the Llama 3 paper (Dubey et al. 2024, "The Llama 3 Herd of
# Models", section 3.3.4): 419 unexpected interruptions in a 54-day snapshot of pre-training on 16,384 H100s,
# 2,048 servers of 8: 54 x 24 h x 2,048 / 419 = 6,335 hours per node (a cluster of 2,048: one every 3.1 h).
MTBF_HOURS_PER_NODE = 6335.0


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
        # a mixture's numbers are checked whether or not there are experts (a dense run saves them too; which
        # flags a dense run may give at all is command_line.check_features's to say)
        for name in ("moe_aux_coef", "moe_z_coef", "moe_capacity_factor", "moe_bias_rate"):
            _finite_in(name, getattr(self, name), 0, math.inf, ">= 0")
        _highest(self)
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
        most = self.moe_experts / self.moe_top_k   # C = ceil(factor * N * k / E) reaches N there (moe.capacity)
        if self.moe_capacity_factor > most:
            raise UserError(f"--moe-capacity-factor {self.moe_capacity_factor:g} is above --moe-experts / --moe-top-k "
                            f"= {most:g}: at {most:g} each expert already takes every token (capacity C = the "
                            f"tokens, none dropped) and a larger factor only grows its buffer (E x C rows a sparse "
                            f"layer); give at most {most:g}, or 0 (dropless)")


@dataclass
class RunConfig(config.TrainConfig):
    """config.TrainConfig (the batch, AdamW, the layout, the precision) and the machinery around the step:
    the data's files, the workers, logging, evaluation, checkpoints, the tools."""

    preset: str = "default"
    # data (run/data.py)
    data: str = ""               # "" = the built-in corpus (Python's standard library sources)
    tokenizer: str = ""          # path to an existing SentencePiece tokenizer.model
    cache_dir: str = ""          # tokenizer + token shards cache ("" = ~/.cache/nanohlat)
    out_dir: str = "out"
    # starting the workers (run/launch.py)
    nproc: int = 1               # worker processes train.py starts itself
    max_restarts: int = 0
    zero1: bool = False          # the older spelling of --zero 1
    compile: bool = False        # torch.compile the model stage (nanohlat/tools/compile.py)
    # logging, evaluation, checkpoints (run/session.py, run/trainlog.py, run/checkpoint/)
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 1
    save_every: int = 0          # 0 = only at the end; SAVE_EVERY_AUTO (--save-every auto): Young/Daly's
                                 # interval, made a number by the pre-flight (plan/failures.py:resolve_save_every)
    async_save: bool = False     # checkpoints written by a background thread (run/checkpoint/background.py)
    keep_last: int = 3           # 0 = keep every checkpoint
    resume: str = "auto"         # auto | never | PATH
    overwrite: bool = False      # with --resume never: replace an existing run
    max_bad_steps: int = 5       # NaN/inf steps in a row before the run stops (0 = never stop)
    check_replicas: int = 0      # every N steps compare the replicas of every parameter (0 = never)
    allow_tokenizer_change: bool = False   # resume a run whose tokenizer differs from this one's
    stop_after: int = 0          # stop (as if interrupted) after this step; 0 = never
    # failures at scale: the plan's checkpoint interval (plan/failures.py), the straggler watch (run/stragglers.py)
    mtbf_hours: float = MTBF_HOURS_PER_NODE   # one node's mean time between failures, in hours
    storage_gb_s: float = 1.0    # GB/s one node writes a checkpoint at (Llama 3's storage: 2 TB/s over 2,048 nodes)
    straggler_every: int = 100   # every N steps, name a rank much slower than the others (0 = never)
    straggler_factor: float = 1.5   # ... slower than the median rank by more than this factor
    timeline: bool = False
    plan: bool = False
    search: bool = False         # with --plan: rank every layout that fits by estimated step time
    html: str = ""               # with --plan: write the planner as a page here (plan/page.py)
    measured: tuple = ()         # with --html: run folders whose measured bytes the page sets beside the plan
    progress: bool = True

    def __post_init__(self) -> None:
        if self.zero1:   # --zero1 is --zero 1 (resolve refuses --zero1 --zero 2), folded in once: a copy
            self.zero, self.zero1 = self.zero or 1, False   # (dataclasses.replace) must not fold it again


@dataclass
class TrainConfig(RunConfig):
    """RunConfig, and the layouts beyond the core's: the interleaved schedule's chunks, expert parallelism,
    context parallelism (their modules in nanohlat/beyond/). Every command takes this one."""

    virtual_stages: int = 1      # interleaved: model chunks per pipeline stage (schedules.py:chunk_layers)
    ep: int = 1                  # expert parallelism: dp ranks sharing a mixture's experts (moe.py)
    cp: int = 1                  # context parallelism: ranks sharing each sequence (context_parallel.py)
    cp_attention: str = "allgather"   # allgather | ring | ulysses: attention across the cp ranks
    fp8: str = "none"            # none | tensorwise | delayed | rowwise | blockwise | mx (beyond/fp8.py)
    fp8_grad_format: str = "e5m2"   # --fp8: the gradients' format (e5m2 | e4m3; weights, activations: e4m3)
    fp8_history: int = 16        # --fp8 delayed: steps of amax history a scale is taken from
    fp8_margin: int = 0          # --fp8 delayed: each scale divided by 2^margin (headroom)
    fp8_stats: int = 0           # --fp8: every N steps log each linear's FP8 figures (0 = never)

    def validate(self) -> None:
        check_counts(self)
        for name in ("steps", "batch_size", "seq_len", "microbatches", "nproc", "tp", "pp", "ep", "cp"):
            if getattr(self, name) <= 0:
                raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("save_every", "keep_last", "max_bad_steps", "check_replicas", "eval_every", "eval_batches",
                     "max_restarts", "stop_after", "threads", "straggler_every"):
            if getattr(self, name) < 0 and not (name == "save_every" and self.save_every == SAVE_EVERY_AUTO):
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
            "fp8": ("none",) + FP8_RECIPES,
            "fp8_grad_format": FP8_GRAD_FORMATS,
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
        _highest(self)   # (each against its largest value, HIGHEST)
        _finite_in("rendezvous_timeout", self.rendezvous_timeout, 0, math.inf, "> 0 seconds", low_open=True)
        _finite_in("collective_timeout", self.collective_timeout, 0, math.inf, "> 0 seconds", low_open=True)
        _finite_in("mtbf_hours", self.mtbf_hours, 0, math.inf, "> 0 hours", low_open=True)
        _finite_in("storage_gb_s", self.storage_gb_s, 0, math.inf, "> 0 GB/s", low_open=True)
        _finite_in("straggler_factor", self.straggler_factor, 1, math.inf, "> 1", low_open=True)
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
        if self.fp8_history < 1 or self.fp8_stats < 0 or not 0 <= self.fp8_margin <= FP8_MARGIN_MOST:
            raise UserError(f"--fp8-history must be >= 1, --fp8-stats >= 0 and --fp8-margin in [0, {FP8_MARGIN_MOST}] "
                            f"(scale / 2^margin), got {self.fp8_history}, {self.fp8_stats} and {self.fp8_margin}")
        if self.fp8_stats % self.log_every:
            raise UserError(f"--fp8-stats {self.fp8_stats} must be a multiple of --log-every {self.log_every} (its "
                            f"figures go into the logged steps' rows); give a multiple of {self.log_every}")
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
    """Every whole-number field of `cfg` (a ModelConfig or TrainConfig) but --seed in bounds: a size
    (every field of the model's shape, SIZES of the run's) at most MAX_SIZE, any other count at most
    MOST, the most nanohlat records exactly. (A --nproc of 21 digits once hung, counting its divisors.)"""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if type(f.default) is not int or f.name == "seed" or not isinstance(value, int):
            continue
        if (isinstance(cfg, config.ModelConfig) or f.name in SIZES) and value > MAX_SIZE:
            raise UserError(f"{_flag(f.name)} {value:,} is more than 2^24 = {MAX_SIZE:,}, the largest size "
                            f"nanohlat takes; give a smaller one")
        if value > MOST:
            raise UserError(f"{_flag(f.name)} {value} is more than 2^53 = {MOST:,}, the largest count nanohlat "
                            f"records exactly (config.json, checkpoints); give a smaller one")


def check_seed(seed: int) -> None:
    """--seed of every command (train, bench, sample, eval, serving)."""
    if not 0 <= seed < SEED_LIMIT:
        raise UserError(f"--seed must be in [0, 2**63), got {seed}")


def _highest(cfg) -> None:
    """Refuse a float field of `cfg` above its largest value (HIGHEST), naming the value and why."""
    for name, (most, why) in HIGHEST.items():
        value = getattr(cfg, name, None)
        if value is not None and value > most:
            raise UserError(f"{_flag(name)} {value:g} is above {most:.3g} ({why}); give at most {most:.3g}")


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


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def to_dict(model_cfg: ModelConfig, tcfg: TrainConfig) -> dict:
    return {"model": dataclasses.asdict(model_cfg), "train": dataclasses.asdict(tcfg)}


def model_from_dict(d: dict) -> ModelConfig:
    names = {f.name for f in fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in d.items() if k in names})
