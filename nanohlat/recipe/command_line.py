"""train.py's command line: one flag per dataclass field (generated, so that the two never drift),
`--preset` the starting values, the flags given laid over them and checked (`parse_args`)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import fields

from nanohlat.config import UserError
from nanohlat.system import files
from nanohlat.recipe.configs import PRESETS, SAVE_EVERY_AUTO, ModelConfig, TrainConfig, _flag
from nanohlat.recipe.configs import CP_ATTENTIONS, FP8_RECIPES, SCHEDULES
from nanohlat.recipe.layouts import check_cp_layout, check_fp8_recipe, check_moe_layout

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
    "html": "with --plan: also write FILE, one self-contained page: a control per layout flag, and for the layout "
            "chosen the bytes per rank term by term, each collective's bytes, the bubble, the step time, whether it "
            "fits; the --search ranking; the plan against the layout matrix's measured runs (plan/page.py)",
    "measured": "with --html: run folders (a train.py --out-dir) whose measured bytes the page sets beside the plan",
    "threads": "CPU threads per worker (0 = cores / local workers)",
    "save_every": "save a checkpoint every N steps (0 = only at the end; auto = Young/Daly's interval for "
                  "--mtbf-hours and --storage-gb-s, which --plan shows)",
    "async_save": "write checkpoints in a background thread while training goes on: the step's state is copied "
                  "to host memory at the step's end, then written (nanohlat/run/checkpoint/background.py)",
    "mtbf_hours": "one node's mean time between failures, in hours, for the checkpoint interval of --plan and "
                  "--save-every auto (default: Llama 3's 419 failures in 54 days on 2,048 nodes)",
    "storage_gb_s": "GB/s one node writes a checkpoint at, for --plan's save time and --save-every auto "
                    "(default: Llama 3's storage, 2 TB/s sustained shared by 2,048 nodes)",
    "straggler_every": "every N steps gather each rank's own time in the step and name a rank slower than the "
                       "median by --straggler-factor (cpu; 0 = never; nanohlat/run/stragglers.py)",
    "straggler_factor": "a rank whose own time in a step is above this many times the median of the other ranks' is named a straggler",
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
                     "softmax probabilities (mean 1/E) to choose the top-k (never to weigh them), moved by this "
                     "much after each step towards the experts the global batch gave less than their share "
                     "(0 = off; with --moe-aux-coef 0 the only balancing). DeepSeek-V3's 1e-3 moves a bias on "
                     "sigmoid scores (about 0.5): the same share of a score here is about 2e-3 / E (5e-4 at "
                     "E = 4, 3e-5 at E = 64)",
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
    "fp8": "none, or train the decoder's linears and experts with each matmul in FP8, scaled by " + ", ".join(FP8_RECIPES)
           + " (per tensor now, per tensor from past steps' amax, per row with power-of-two scales, DeepSeek-V3's "
             "1x128 tiles and 128x128 blocks, OCP MX's 32-element blocks; emulated exactly: nanohlat/beyond/fp8.py); "
             "with --sequence-parallel it implies --no-sp-regather",
    "fp8_grad_format": "with --fp8: the gradients' format, e5m2 (more range) or e4m3 (more precision, as DeepSeek-V3)",
    "fp8_history": "with --fp8 delayed: steps of amax history each scale is taken from (the max over them)",
    "fp8_margin": "with --fp8 delayed: divide each scale by 2^margin (headroom for a growing amax)",
    "fp8_stats": "with --fp8: every N steps log each linear's amax, scale and saturated / flushed-to-zero fractions "
                 "per operand (metrics.jsonl); the run's end names the worst linears (0 = never)",
}


def build_parser(description: str = "Pre-train a HLAT-style LLaMA model.", cls=argparse.ArgumentParser):
    p = cls(description=description, argument_default=argparse.SUPPRESS)   # cls: system/flags.py's, one-line errors
    for group, cls in (("training", TrainConfig), ("model", ModelConfig)):
        g = p.add_argument_group(group)
        for f in fields(cls):
            kind = type(f.default)
            if kind is bool:
                g.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, help=HELP.get(f.name))
            elif f.name == "save_every":
                g.add_argument(_flag(f.name), type=save_every_value, metavar="N|auto", help=HELP[f.name])
            elif kind is tuple:   # (--measured DIR...: one or more)
                g.add_argument(_flag(f.name), nargs="+", metavar="DIR", help=HELP.get(f.name))
            else:
                g.add_argument(_flag(f.name), type=kind, metavar=f.name.upper(), help=HELP.get(f.name, f"(default {f.default!r})"))
    return p


def save_every_value(text: str) -> int:
    """--save-every: a whole number of steps, or `auto` (SAVE_EVERY_AUTO until the pre-flight resolves it)."""
    if text.strip() == "auto":
        return SAVE_EVERY_AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: give a whole number of steps or auto") from None


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
    tcfg = dataclasses.replace(tcfg, **{k: tuple(v) if isinstance(v, list) else v for k, v in flags.items()
                                        if k not in model_names})
    if tcfg.fp8 != "none" and tcfg.sequence_parallel:
        # an FP8 linear casts its whole input itself: SP's gather comes first, and the linear keeps what it casts
        if flags.get("sp_regather"):
            raise UserError("--fp8 with --sp-regather: an FP8 linear casts its gathered input itself and keeps it "
                            "for its backward (--no-sp-regather's way); drop --sp-regather")
        tcfg = dataclasses.replace(tcfg, sp_regather=False)
    model_cfg.validate()
    tcfg.validate()
    check_features(model_cfg, tcfg)
    if tcfg.fp8 != "none":
        check_fp8_recipe(model_cfg, tcfg)
    check_page_paths(tcfg)
    if model_cfg.moe_experts or tcfg.ep > 1:
        check_moe_layout(model_cfg, tcfg)
    if tcfg.cp > 1:
        check_cp_layout(model_cfg, tcfg)
    if tcfg.seq_len > model_cfg.max_seq_len:
        raise UserError(f"--seq-len {tcfg.seq_len} is above the model maximum {model_cfg.max_seq_len}; "
                        f"lower --seq-len or raise --max-seq-len")
    return model_cfg, tcfg


# A flag that only one feature reads, with what turns the feature on and why it needs it: a run without the
# feature refuses the flag at any value but its default (a dense run took --moe-bias-rate nan, saved it, and
# every later reader called the checkpoint damaged). Presets set only what their features read.
FEATURE_FLAGS = {
    **{name: (lambda m, t: m.moe_experts > 0, "--moe-experts", "a dense model, --moe-experts 0, has no router "
              "or experts for it") for name in ("moe_top_k", "moe_shared_experts", "moe_every", "moe_aux_coef",
                                                "moe_z_coef", "moe_bias_rate", "moe_capacity_factor")},
    "cp_attention": (lambda m, t: t.cp > 1, "--cp N (N >= 2)", "it chooses how attention crosses the cp ranks"),
    "sp_regather": (lambda m, t: t.sequence_parallel, "--sequence-parallel", "it says what SP keeps for backward"),
    "search": (lambda m, t: t.plan, "--plan", "it ranks the layouts in the plan; without --plan train.py trains"),
    "straggler_factor": (lambda m, t: t.straggler_every > 0, "--straggler-every N (N >= 1)",
                         "it is the straggler watch's threshold, and --straggler-every 0 turns the watch off"),
    **{name: (lambda m, t: t.fp8 != "none", "--fp8", "it says how FP8 casts and logs") for name in
       ("fp8_grad_format", "fp8_stats")},
    **{name: (lambda m, t: t.fp8 == "delayed", "--fp8 delayed", "only delayed scaling keeps an amax history")
       for name in ("fp8_history", "fp8_margin")},
    "html": (lambda m, t: t.plan, "--plan", "it writes the plan as a page; without --plan train.py trains"),
    "measured": (lambda m, t: bool(t.html), "--html FILE", "it sets runs beside the plan on the page"),
}


def check_page_paths(tcfg: TrainConfig) -> None:
    """--html FILE and --measured DIR...: refused in one line before any work, nothing written. FILE must be
    a new or regular file in an existing folder: never a symbolic link (the page is not written through one,
    nor does it silently replace it), a FIFO, a device or a folder (files.refuse_unless_file); each DIR a
    train.py run's folder (its config.json and summary.json: plan/measured.py reads them)."""
    if not tcfg.html:
        return
    path = tcfg.html
    if os.path.islink(path):
        raise UserError(f"--html {path!r} is a symbolic link: the planner page is written as a regular file, never "
                        f"through a link nor over one; remove the link or choose another path")
    files.refuse_unless_file(path, "another --html")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        what = "not a writable folder" if os.path.isdir(folder) else "not a folder"
        raise UserError(f"--html {path!r}: {folder!r} is {what}; choose a path in a folder that exists and that "
                        f"you can write")
    for run in tcfg.measured:
        missing = [n for n in ("config.json", "summary.json") if not os.path.isfile(os.path.join(run, n))]
        if missing:
            raise UserError(f"--measured {run!r} has no {' or '.join(missing)}: give the --out-dir of a finished "
                            f"train.py run")


def check_features(model_cfg: ModelConfig, tcfg: TrainConfig) -> None:
    """Refuse, in one line, a flag given a value other than its default for a feature the run does
    not use (FEATURE_FLAGS): `--moe-bias-rate 1e-3` without --moe-experts, `--search` without --plan."""
    for name, (on, needs, why) in FEATURE_FLAGS.items():
        cfg = model_cfg if hasattr(model_cfg, name) else tcfg
        value, default = getattr(cfg, name), next(f.default for f in fields(cfg) if f.name == name)
        if value != default and not on(model_cfg, tcfg):
            given = _flag(name) if value is True else "--no-" + _flag(name)[2:] if value is False \
                else f"{_flag(name)} {value:g}" if isinstance(value, float) \
                else f"{_flag(name)} {' '.join(value)}" if isinstance(value, tuple) else f"{_flag(name)} {value}"
            raise UserError(f"{given} needs {needs} ({why}); give {needs} too, or drop {given.split()[0]}")


def parse_args(argv=None, cls=argparse.ArgumentParser) -> tuple[ModelConfig, TrainConfig]:
    return resolve(vars(build_parser(cls=cls).parse_args(argv)))
