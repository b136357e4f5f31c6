"""Benchmark one training step: tokens/s and MFU, nanohlat beside Hugging Face.

    python -m nanohlat.bench                          # default preset, batch 8, this machine
    python -m nanohlat.bench --n-layers 6 --d-model 384 --n-heads 6 --n-kv-heads 6 \\
        --ffn-dim 1024 --vocab-size 4096 --batch-size 8 --seq-len 256 --threads 2   # the 13.8M reference
    python -m nanohlat.bench --preset 125m --seq-len 1024 --device cuda --precision bf16
    python -m nanohlat.bench --profile                # + where the time goes, per op
    python -m nanohlat.bench --generate               # serving: prefill, decode, batching (generate_bench)
    python -m nanohlat.bench --engines eager,compile,xla   # eager vs torch.compile vs XLA

What is timed is the whole single-process training step of train.py, built by
the same `build.build` (model, runner, optimizer): forward, loss, backward
(through `pipeline.PipelineRunner`, as train.py runs it; the gradients go into
FlatAdamW's flat fp32 buffers: in fp32 on the CPU autograd adds them into views
of the buffers, tools/fast_adamw.py) and the optimizer step (global grad
norm, clip, AdamW, copy back: tools/fast_adamw.py's FastFlatAdamW on the CPU).
Beside it, when `transformers` is installed, the same step of Hugging Face's
`LlamaForCausalLM` of identical shape (same parameter count, checked) with
`clip_grad_norm_` and `torch.optim.AdamW` as fast as torch makes it for the
device and dtype: `fused=True` where torch has the kernel (the CPU's and
CUDA's), else `foreach` (mixtral.hf_adamw; the bench prints which). That is
the baseline a user would pick instead of nanohlat; torch's default on the
CPU, a Python loop over the tensors, would flatter nanohlat's optimizer.
With --compile the reference runs a second time with its model through
torch.compile (`hf-llama-compile`), the baseline of nanohlat-compile.
On the CPU every model here runs with the allocator train.py sets
(run/cpu_memory.py: what a step frees stays for the next step, not faulted in
again page by page); the header says so, or that the C library's malloc runs
as it is.

The steps alternate step by step (and who goes first every round), each
engine next to its reference, so that load from anything else on the machine
hits both alike. The ratio the last lines print is the median, over the
rounds, of each round's two steps' ratio, with the middle half of those
ratios (`spread`): on a shared or throttling machine that middle half can be
+-5% wide, and a difference inside it is not a measured one. The table gives
each row's median step and its two phases, forward + backward and the
optimizer, for both sides. Beside the ratios the bench prints the machine's
1-minute load average (os.getloadavg) before and after the timing: where it
is above the core count, other work shared the cores, and the bench says the
figures are not a result. At --threads 1 it also prints the same ratio of CPU
times (time.process_time per step): a core taken away by other work is not
in it, so on a busy machine it says more about the two steps than wall time
does (not all: they still share caches and memory with that work).

tokens/s = batch_size * seq_len / median step time, and MFU is
metrics.flops_per_token * tokens/s / metrics.device_peak (the same FLOP count
for both models: they have the same shape). Data are random token ids: speed
does not depend on what the tokens say.

Engines (--engines, default eager): the same nanohlat step run eagerly
(`nanohlat`), with torch.compile (`nanohlat-compile`: the model stage and
the optimizer's arithmetic compiled, what train.py --compile runs; --compile alone means
--engines eager,compile) and on an XLA device (`nanohlat-xla`, where
torch_xla is installed: PJRT's CPU client on a laptop). All of them and
the references alternate in one loop. Per row the table shows
the first step (where the compilers compile), the median steady step,
tokens/s, MFU, the graphs compiled during warm-up and any compiled after it
(recompilations: there should be none), tokens/s relative to its reference
(`vs ref`: the compiled reference for nanohlat-compile, else the eager one),
and the two phases.

This is a benchmark, not a test: it asserts nothing about speed. Every flag of
train.py that shapes one process's step works (the model shape, a mixture of
experts: timed beside Hugging Face's Mixtral instead, mixtral.py; --precision, --device,
--threads ...), and those it would not run (--nproc, --dp, --tp, --pp, --cp,
--ep, --microbatches above 1) are refused; the
bench changes two defaults, --batch-size 8 and --steps 10 (timed steps per
model, after --warmup untimed ones).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch
import torch.nn.functional as F

from nanohlat import comm, xla
from nanohlat import recipe
from nanohlat.tools import metrics
from nanohlat.run import cpu_memory, preflight, runconfig
from nanohlat.system.flags import Parser
from nanohlat.tools import compile as compilelib
from nanohlat import device as devicelib
from nanohlat import mesh as meshlib
from nanohlat.run.build import build, decoder
from nanohlat.config import UserError
from nanohlat.system import cli
from nanohlat.model import init_weights
from nanohlat.precision import param_dtype
from nanohlat.bench import mixtral
from nanohlat.bench.ratios import load_line, ratio_line, report, spread

BENCH_DEFAULTS = {"batch_size": 8, "steps": 10}
ENGINES = {"eager": "nanohlat", "compile": "nanohlat-compile", "xla": "nanohlat-xla"}   # --engines -> row name


def wait(dev) -> None:
    """Block until the device has finished everything queued: a step's time
    means nothing on an asynchronous device (CUDA, XLA) without this."""
    if dev.kind == "cuda":
        torch.cuda.synchronize(dev.torch_device)
    elif dev.kind == "xla":
        dev.sync()
        import torch_xla.core.xla_model as xm
        xm.wait_device_ops()


def mark(dev) -> float | None:
    """The time at the end of forward + backward, for the split of a step into
    its two phases; None on XLA, where waiting mid-step would cut the step's
    graph in two and change what is being measured."""
    if dev.kind == "xla":
        return None
    wait(dev)
    return time.perf_counter()


def random_batch(model_cfg, tcfg, dev):
    """(tokens, targets), each (B, T): random ids below the real vocabulary."""
    g = torch.Generator().manual_seed(tcfg.seed)
    batch = torch.randint(0, model_cfg.vocab_size, (tcfg.batch_size, tcfg.seq_len + 1), generator=g)
    batch = batch.to(dev.torch_device)
    return batch[:, :-1], batch[:, 1:]


class Timed:
    """A training step to time: calling it runs `run` (which returns its forward + backward seconds, or
    None, and its loss) and returns the seconds; `first_loss` keeps the first step's loss (a tensor), for
    the comparison of nanohlat's with Hugging Face's; `opt`: a reference's optimizer (which AdamW it is)."""

    def __init__(self, run, opt=None):
        self.run, self.first_loss, self.opt = run, None, opt

    def __call__(self):
        seconds, loss = self.run()
        if self.first_loss is None:
            self.first_loss = loss
        return seconds


def nanohlat_step(model_cfg, tcfg, dev, tokens, targets):
    """nanohlat's single-process training step, as train.py runs it. Returns (step, model): a Timed."""
    mesh = meshlib.Mesh(1, 1, 1, ledger=comm.CommLedger())
    model, runner, opt = build(model_cfg, tcfg, mesh, dev)   # what train.py builds
    B, T = tokens.shape
    tokens, targets = [tokens], [targets]   # one micro-batch

    def step():
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = runner.run(tokens, targets, 1.0 / (B * T))
        t1 = mark(dev)
        opt.step(tcfg.lr)
        dev.sync()
        return (t1 - t0 if t1 else None), loss.detach()

    return Timed(step), model


def hf_step(model_cfg, tcfg, dev, tokens, targets, compile: bool = False):
    """The same step for transformers' LlamaForCausalLM + torch.optim.AdamW (fused:
    mixtral.hf_adamw), its forward through torch.compile with `compile`: (step, model), the step a
    Timed with its optimizer; or None when transformers is not installed."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    hf_cfg = LlamaConfig(
        hidden_size=model_cfg.d_model, intermediate_size=model_cfg.ffn_dim,
        num_hidden_layers=model_cfg.n_layers, num_attention_heads=model_cfg.n_heads,
        num_key_value_heads=model_cfg.n_kv_heads, vocab_size=model_cfg.padded_vocab,
        max_position_embeddings=model_cfg.max_seq_len, rms_norm_eps=model_cfg.norm_eps,
        rope_theta=model_cfg.rope_theta, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(tcfg.seed)
    model = LlamaForCausalLM(hf_cfg).to(device=dev.torch_device, dtype=param_dtype(tcfg.precision))
    model.train()
    opt = mixtral.hf_adamw(model, tcfg)                 # (weight decay on matrices only, as nanohlat)
    V = model_cfg.padded_vocab
    forward = torch.compile(model) if compile else model

    def step():
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = forward(input_ids=tokens).logits                            # (B, T, V)
        loss = F.cross_entropy(logits.float().view(-1, V), targets.reshape(-1))
        loss.backward()
        t1 = mark(dev)
        torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
        opt.step()
        dev.sync()
        return (t1 - t0 if t1 else None), loss.detach()

    return Timed(step, opt), model


class GraphTally:
    """torch.compile's graphs by the row that compiled them: Dynamo counts one total for the
    process (compile.stats), and nanohlat and the compiled reference both compile; called with a
    row's name right after its step (untimed), it gives that row the graphs made since the last call."""

    def __init__(self):
        self.by, self.last = {}, compilelib.stats()["graphs"]

    def __call__(self, name: str) -> None:
        now = compilelib.stats()["graphs"]
        self.by[name], self.last = self.by.get(name, 0) + now - self.last, now


def warm_up(steps: dict, devs: dict, n: int, after=None) -> dict:
    """Run n untimed steps of each step function (at least one); returns
    {name: seconds of its first step}: where torch.compile and XLA compile.
    `after(name)`, if given, runs after each step, untimed."""
    first = {}
    for i in range(max(n, 1)):
        for name, step in steps.items():
            wait(devs[name])
            t0 = time.perf_counter()
            step()
            wait(devs[name])
            if i == 0:
                first[name] = time.perf_counter() - t0
            if after is not None:
                after(name)
    return first


def time_interleaved(steps: dict, n: int, devs: dict, between=None, after=None) -> tuple[dict, dict]:
    """Seconds per step of each named step function, alternating them step by
    step (and who goes first, every round) so machine load falls on all alike;
    `between()`, if given, runs after each round, `after(name)` after each step, untimed.
    Returns ({name: [step seconds]}, {name: [forward + backward seconds]},
    {name: [CPU seconds of this process per step, every thread's]})."""
    names = list(steps)
    times = {name: [] for name in names}
    fwd_bwd = {name: [] for name in names}
    cpu = {name: [] for name in names}
    for i in range(n):
        for name in (names if i % 2 == 0 else names[::-1]):
            wait(devs[name])
            t0, c0 = time.perf_counter(), time.process_time()
            fb = steps[name]()
            wait(devs[name])
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            if fb is not None:
                fwd_bwd[name].append(fb)
            if after is not None:
                after(name)
        if between is not None:
            between()
    return times, fwd_bwd, cpu


def profile(steps: dict, devs: dict, n: int = 3, rows: int = 25) -> str:
    """torch.profiler's op table (self time) for n steps of each model."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    out = []
    for name, step in steps.items():
        dev = devs[name]
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.kind == "cuda" else [])
        sort = "self_cuda_time_total" if dev.kind == "cuda" else "self_cpu_time_total"
        with torch_profile(activities=activities) as prof:
            for _ in range(n):
                step()
            wait(dev)
        out.append(f"\n=== {name}: {n} steps, ops by self time ===")
        out.append(prof.key_averages().table(sort_by=sort, row_limit=rows))
    return "\n".join(out)


def parse(argv):
    """train.py's flags (model shape, precision, device ...) plus the bench's own."""
    parser = recipe.build_parser("Time nanohlat's training step (and Hugging Face Llama's) on this machine.",
                                 Parser)
    b = parser.add_argument_group("bench")
    b.add_argument("--warmup", type=int, default=2, help="untimed steps per model first (default 2)")
    b.add_argument("--no-hf", dest="hf", action="store_false", default=True,
                   help="skip the Hugging Face comparison")
    b.add_argument("--profile", action="store_true", default=False,
                   help="also print torch.profiler's top ops for each model")
    b.add_argument("--generate", action="store_true", default=False,
                   help="time generation instead: prefill/decode for batch 1..--batch-size, the bandwidth "
                        "bound, static vs continuous batching")
    b.add_argument("--engines", default="eager",
                   help="comma-separated: eager (nanohlat as train.py runs it), compile (torch.compile of "
                        "the model stage and the optimizer's arithmetic, train.py --compile), xla (torch_xla) (default eager)")
    flags = vars(parser.parse_args(argv))
    own = {k: flags.pop(k) for k in ("warmup", "hf", "profile", "generate", "engines")}
    flags = BENCH_DEFAULTS | flags
    model_cfg, tcfg = recipe.resolve(flags)
    own["engines"] = [e.strip() for e in own["engines"].split(",") if e.strip()]
    unknown = sorted(set(own["engines"]) - set(ENGINES))
    if unknown or not own["engines"]:
        raise UserError(f"--engines {','.join(unknown) or '(none)'}: choose from {', '.join(ENGINES)}")
    if tcfg.compile and "compile" not in own["engines"]:   # --compile: the compiled engine beside eager
        own["engines"].append("compile")
    others = [f"--{n.replace('_', '-')} {getattr(tcfg, n)}" for n in ("nproc", "dp", "tp", "pp", "cp", "ep",
                                                                        "microbatches") if getattr(tcfg, n) > 1]
    if others:   # (--dp 0 is "what the world leaves": 1 here)
        raise UserError(f"the bench times one process, one micro-batch: {', '.join(others)} would not be run; "
                        f"leave --nproc, --dp, --tp, --pp, --cp, --ep and --microbatches at 1 (train.py --nproc N "
                        f"times a layout: its tokens/s and MFU are logged)")
    if own["warmup"] < 0:
        raise UserError(f"--warmup must be >= 0, got {own['warmup']}")
    prompt = min(tcfg.seq_len, model_cfg.max_seq_len) // 2     # generate_bench's prompts: 8 .. prompt tokens
    if own["generate"] and (prompt < 8 or model_cfg.max_seq_len - prompt < 8):
        raise UserError(f"--generate times prompts of 8 to --seq-len / 2 tokens and at least 8 new tokens: "
                        f"give --seq-len >= 16 and --max-seq-len >= --seq-len / 2 + 8 (got {tcfg.seq_len}, "
                        f"{model_cfg.max_seq_len})")
    return model_cfg, tcfg, argparse.Namespace(**own)


@cli.command
def main(argv=None) -> int:
    model_cfg, tcfg, args = parse(sys.argv[1:] if argv is None else argv)
    dev = devicelib.get_device(tcfg.device)
    if args.generate:   # this machine's memory before anything is allocated: one model, or a training step's
        runconfig.check_fits(model_cfg, dev.kind, "the flags (--d-model, --n-layers, --max-seq-len, ...)")
    else:
        preflight.check_memory(model_cfg, tcfg, 1, 1, spawns=False)
    kept = False   # as train.py's CPU processes: what a step frees stays in the process, for every model here
    if dev.kind == "cpu":
        devicelib.set_cpu_threads(tcfg.threads or os.cpu_count() or 1)
        kept = cpu_memory.keep_freed_memory()   # (run/cpu_memory.py)
    threads = torch.get_num_threads() if dev.kind == "cpu" else None
    if args.generate:
        return generate_bench(model_cfg, tcfg, dev)
    tokens, targets = random_batch(model_cfg, tcfg, dev)

    steps, models, devs, graphs = build_engines(args.engines, model_cfg, tcfg, dev, tokens, targets)
    if not steps:
        print("error: none of --engines can run here", file=sys.stderr)
        return 2
    # the references: Hugging Face's Llama of the same shape, or for a mixture of experts its Mixtral
    # (from nanohlat's initial weights: mixtral.py), unless the mixture is one Mixtral cannot express;
    # each with torch's fastest AdamW for the device (mixtral.hf_adamw). The compiled engine is timed
    # beside the reference through torch.compile, the others beside the eager reference (`pairs`)
    ref = mixtral.NAME if model_cfg.moe_experts else "hf-llama"
    pairs = {name: ref + "-compile" if name == ENGINES["compile"] else ref for name in steps}
    refs = {}
    if args.hf:
        refs = references(sorted(set(pairs.values())), model_cfg, tcfg, dev, tokens, targets)
        if refs is None:
            print("(transformers is not installed: timing nanohlat alone; pip install transformers)")
            refs = {}
    for name, (step, model) in refs.items():
        n_ours, n_hf = (sum(p.numel() for p in m.parameters()) for m in (next(iter(models.values())), model))
        if ref == mixtral.NAME:   # (Mixtral's embedding and head have vocab_size rows, nanohlat's padded_vocab)
            n_hf += 2 * (model_cfg.padded_vocab - model_cfg.vocab_size) * model_cfg.d_model
        assert n_ours == n_hf, f"shape mismatch: nanohlat {n_ours:,} vs Hugging Face {n_hf:,} parameters"
        models[name], devs[name] = model, dev
    if refs:
        any_ref = next(iter(refs.values()))
        if ref == mixtral.NAME:
            print(f"{ref}: Hugging Face's MixtralForCausalLM, experts computed by its "
                  f"'{mixtral.experts_implementation(any_ref[1])}' implementation")
        print(f"{ref}: torch.optim.AdamW({mixtral.adamw_kind(any_ref[0].opt)}=True), torch's fastest for "
              f"{dev.kind} {tcfg.precision}, and clip_grad_norm_" + ("; its forward compiled for the compiled "
                                                                      "engine" if ref + "-compile" in refs else ""))
        # each engine and its reference run back to back in every round (the order reverses every
        # round): the pairs of `spread` are two neighbouring steps
        steps = ordered(steps, {n: s for n, (s, _) in refs.items()}, pairs)
    pairs = {n: r for n, r in pairs.items() if r in steps}
    tally = GraphTally()   # torch.compile's graphs, by the row whose step compiled them
    for name in steps:
        if name.endswith("-compile"):
            graphs[name] = lambda name=name: tally.by.get(name, 0)

    tok_per_step = tcfg.batch_size * tcfg.seq_len
    flops_tok = metrics.flops_per_token(model_cfg, tcfg.seq_len)
    where = f"{dev.name} ({threads} threads)" if threads else dev.name
    print(f"model: {model_cfg.n_layers} layers, d_model {model_cfg.d_model}, {model_cfg.n_heads} heads "
          f"({model_cfg.n_kv_heads} kv), ffn {model_cfg.ffn_dim}, vocab {model_cfg.padded_vocab}: "
          f"{model_cfg.num_params() / 1e6:.2f}M parameters, {flops_tok / 1e6:.1f} MFLOP/token")
    print(f"step: batch {tcfg.batch_size} x seq {tcfg.seq_len} = {tok_per_step:,} tokens, {tcfg.precision}, "
          f"on {where}")
    if dev.kind == "cpu":
        print("memory: " + ("what a step frees stays for the next step, for every model here (glibc's malloc "
                            "with the two settings train.py makes: run/cpu_memory.py)" if kept else
                            "the C library's malloc as it is (not glibc, or its mallopt refused: run/cpu_memory.py)"))
    print(f"timing {tcfg.steps} steps per model after {max(args.warmup, 1)} warm-up, interleaved ...", flush=True)

    load_before = os.getloadavg()[0]
    first = warm_up(steps, devs, args.warmup, tally)       # the compilers compile here
    compiled = {name: count() for name, count in graphs.items()}
    # on the CPU the peak is measured again after every round (the best counts): see metrics.resample_cpu_peak
    times, fwd_bwd, cpu = time_interleaved(steps, tcfg.steps, devs,
                                      metrics.resample_cpu_peak if dev.kind == "cpu" else None, tally)
    load = (load_before, os.getloadavg()[0])
    recompiled = {name: count() - compiled[name] for name, count in graphs.items()}
    peak = metrics.device_peak(dev, tcfg.precision)   # the definition train.py uses
    print(metrics.describe_peak(dev, tcfg.precision) + ("; sampled again after every round, the best kept" if dev.kind == "cpu" else ""))
    print()
    print(report(times, fwd_bwd, first, compiled, recompiled, tok_per_step, flops_tok, peak, pairs))
    if any(name.endswith("-compile") for name in steps):
        st = compilelib.stats()
        print("\n" + ", ".join(f"{n}: {tally.by.get(n, 0)} graph(s)" for n in steps if n.endswith("-compile"))
              + f"; {st['graph_breaks']} graph break(s) in all" + "".join(f"\n  break: {r}" for r in st["break_reasons"]))
    if args.profile:
        print(profile(steps, devs))
    if pairs:   # eager and compile last, as the README quotes them
        ours = sorted(pairs, key=lambda n: n != "nanohlat-xla")
        print()
        if ref == mixtral.NAME:   # the same weights, the same batch: the same first loss, or no comparison
            line, same = mixtral.first_losses(steps[ours[-1]].first_loss, steps[pairs[ours[-1]]].first_loss,
                                              tcfg.precision)
            print(line)
            if not same:
                print(f"error: {line}", file=sys.stderr)
                return 1
        print(spread(times, ours, pairs))
        print()
        print(load_line(load, os.cpu_count() or 1, threads))
        for name in ours:
            print(ratio_line(times, name, pairs[name]))
        if threads == 1:   # one thread: its CPU time is the step's work, whatever else shares the cores
            print("CPU time per step (one thread: the time other work took the core away is not in it):")
            for name in ours:
                print("  " + ratio_line(cpu, name, pairs[name], "CPU time"))
    return 0


def references(names, model_cfg, tcfg, dev, tokens, targets) -> dict | None:
    """{row name: (step, model)} of each Hugging Face reference asked for (hf-llama, hf-mixtral,
    `-compile`: its forward through torch.compile); None without transformers. UserError (from
    mixtral.py) for a mixture Mixtral cannot express: printed, and {} returned."""
    out = {}
    for name in names:
        compile = name.endswith("-compile")
        try:
            hf = (mixtral.hf_mixtral_step(model_cfg, tcfg, dev, tokens, targets, mark, Timed, compile)
                  if model_cfg.moe_experts else hf_step(model_cfg, tcfg, dev, tokens, targets, compile))
        except UserError as e:
            print(f"(no Hugging Face model of this shape, timing nanohlat alone: {e})")
            return {}
        if hf is None:
            return None
        out[name] = hf
    return out


def ordered(ours: dict, refs: dict, pairs: dict) -> dict:
    """nanohlat's engines and the references in the order of a round: each engine next to its
    reference (the eager pair, then the compiled pair: reference first, so it sits in the middle of
    the round), then the others."""
    order = []
    for name in ours:
        partner = pairs[name] if pairs[name] in refs and pairs[name] not in order else None
        order += [name, partner] if name == ENGINES["eager"] else [partner, name]
    steps = ours | refs
    return {n: steps[n] for n in order if n is not None}


def build_engines(engines, model_cfg, tcfg, dev, tokens, targets):
    """nanohlat's step once per engine: ({row name: step}, {row name: model},
    {row name: device}, {row name: graphs compiled so far, a function})."""
    steps, models, devs, graphs = {}, {}, {}, {}
    for engine in engines:
        name, edev, etok, etgt = ENGINES[engine], dev, tokens, targets
        if engine == "xla":
            if not xla.installed("torch_xla"):
                print("(xla: torch_xla is not installed here, no xla engine; .ci/xla-lane installs it)")
                continue
            edev = devicelib.get_device("xla", 0, tcfg.precision)
            etok, etgt = tokens.to(edev.torch_device), targets.to(edev.torch_device)
            graphs[name] = xla.compile_count
        if engine == "compile":
            compilelib.reset()
            graphs[name] = lambda: compilelib.stats()["graphs"]
        # build() compiles the model stage and the optimizer's arithmetic when compile=True, as in train.py
        etcfg = dataclasses.replace(tcfg, compile=engine == "compile")
        steps[name], models[name] = nanohlat_step(model_cfg, etcfg, edev, etok, etgt)
        devs[name] = edev
    return steps, models, devs, graphs


# ---------------------------------------------------------------------------
# --generate: serving speed (serving/generate.py, serving/server.py; tutorial chapter 9)
# ---------------------------------------------------------------------------

def read_bandwidth(dev, mib: int = 256, repeats: int = 5) -> float:
    """Bytes/s this device reads memory at, measured now: the best of a few
    sums over a tensor far larger than any cache (1 GiB on a GPU)."""
    mib = 1024 if dev.kind == "cuda" else mib
    x = torch.ones(mib * 2**20 // 4, device=dev.torch_device)
    best = float("inf")
    for _ in range(repeats + 1):                       # the first one warms up
        wait(dev)
        start = time.perf_counter()
        x.sum()
        wait(dev)
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def decode_bytes(model_cfg, batch: int, context: float, e: int) -> tuple[float, float]:
    """(weight bytes, KV-cache bytes) one decode step reads: every matrix once
    (the embedding table only B rows: left out), and each row's cache of
    `context` tokens: 2 (k, v) x layers x kv heads x head dim x e bytes per token."""
    weights = (model_cfg.num_params() - model_cfg.padded_vocab * model_cfg.d_model) * e
    kv = batch * context * 2 * model_cfg.n_layers * model_cfg.n_kv_heads * model_cfg.head_dim * e
    return weights, kv


def generate_bench(model_cfg, tcfg, dev) -> int:
    """prefill and decode tokens/s for batch sizes 1, 2, 4 .. --batch-size, the
    memory-bandwidth bound of decode, and static vs continuous batching on one
    simulated request stream. Random weights: speed does not depend on them."""
    from nanohlat.serving import generate as gen, server as serving
    model = decoder(model_cfg)
    init_weights(model, tcfg.seed)
    dtype = param_dtype(tcfg.precision)
    model.to(device=dev.torch_device, dtype=dtype).eval()
    e = torch.finfo(dtype).bits // 8
    P = min(tcfg.seq_len, model_cfg.max_seq_len) // 2       # prompt tokens
    n = min(32, model_cfg.max_seq_len - P)                 # decode steps timed
    g = torch.Generator().manual_seed(tcfg.seed)
    bw = read_bandwidth(dev)
    where = f"{dev.name} ({torch.get_num_threads()} threads)" if dev.kind == "cpu" else dev.name
    print(f"model: {model_cfg.num_params() / 1e6:.2f}M parameters, random weights (speed does not depend on "
          f"them), {tcfg.precision}, on {where}")
    print(f"memory bandwidth: {bw / 1e9:.1f} GB/s (measured: best sum over a large fp32 tensor)")
    print(f"prompt {P} tokens, then {n} decode steps (context {P}..{P + n}); decode bound = bandwidth x B / "
          f"(weight bytes + B x KV bytes per row)\n")
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64) if b < tcfg.batch_size] + [tcfg.batch_size]
    rows, rates = [], {}
    for B in sizes:
        prompts = torch.randint(0, model_cfg.vocab_size, (B, P), generator=g).tolist()
        cache = gen.new_cache(model, B, P + n)
        times = []
        for _ in range(3):                                       # best of 3 prefills (the first warms up)
            wait(dev)
            start = time.perf_counter()
            logits = gen.prefill(model, cache, prompts)
            wait(dev)
            times.append(time.perf_counter() - start)
        prefill_rate = B * P / min(times)
        tokens = gen.pick(logits)
        positions = torch.full((B,), P, device=dev.torch_device)
        start = time.perf_counter()
        for _ in range(n):
            tokens = gen.pick(gen.decode_step(model, cache, tokens, positions))
            tokens.tolist()                                      # the host needs each token (eos, streaming)
            positions = positions + 1
        rates[B] = decode_rate = B * n / (time.perf_counter() - start)
        weights, kv = decode_bytes(model_cfg, B, P + n / 2, e)
        bound = bw * B / (weights + kv)
        rows.append([B, f"{prefill_rate:,.0f}", f"{decode_rate:,.0f}", f"{weights / B / 1e6:.2f} MB",
                     f"{kv / B / 1e6:.3f} MB", f"{bound:,.0f}", f"{decode_rate / bound:.0%}"])
    header = ["batch", "prefill tok/s", "decode tok/s", "weights/token", "KV/token", "bound tok/s", "of bound"]
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))

    # static vs continuous batching on the same stream, loaded near the decode capacity
    N = tcfg.batch_size
    new_tokens = (8, min(64, model_cfg.max_seq_len - P))
    rate = rates[N] / (sum(new_tokens) / 2)                  # requests/s the decode rate can sustain
    results = {}
    for name, serve in (("static", serving.serve_static), ("continuous", serving.serve_continuous)):
        stream = serving.arrival_stream(4 * N, rate, model_cfg.vocab_size, tcfg.seed, (8, P), new_tokens)
        results[name] = serve(model, stream, N)
    print(f"\n{4 * N} requests arriving at {rate:.1f}/s (Poisson), prompts 8..{P} tokens, "
          f"{new_tokens[0]}..{new_tokens[1]} new tokens each; {N} rows; greedy")
    print(f"{'scheduler':<12} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'mean latency':>13}")
    for name, r in results.items():
        print(f"{name:<12} {r['tokens']:>7} {r['seconds']:>8.2f} {r['tokens_per_s']:>9,.0f} "
              f"{r['mean_latency_s']:>11.2f} s")
    s, c = results["static"], results["continuous"]
    print(f"continuous / static: throughput {c['tokens_per_s'] / s['tokens_per_s']:.2f}x, "
          f"mean latency {c['mean_latency_s'] / s['mean_latency_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
