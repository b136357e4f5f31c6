"""Benchmark one training step: tokens/s and MFU, nanohlat beside Hugging Face.

    python -m nanohlat.bench                          # default preset, batch 8, this machine
    python -m nanohlat.bench --n-layers 6 --d-model 384 --n-heads 6 --n-kv-heads 6 \\
        --ffn-dim 1024 --batch-size 8 --seq-len 256 --threads 2        # the 13.8M reference
    python -m nanohlat.bench --preset 125m --seq-len 1024 --device cuda --precision bf16
    python -m nanohlat.bench --profile                # + where the time goes, per op

What is timed is the whole single-process training step of train.py: forward,
loss, backward (through `pipeline.PipelineRunner`, as train.py runs it) and
`optim.FlatAdamW.step` (flatten grads, global grad norm, clip, AdamW, copy
back). Beside it, when `transformers` is installed, the same step of Hugging
Face's `LlamaForCausalLM` of identical shape (same parameter count, checked)
with `torch.optim.AdamW` and `clip_grad_norm_`, on the same batch. The two
alternate step by step (and swap who goes first every round), so that load
from anything else on the machine hits both alike; we report the median step.

tokens/s = batch_size * seq_len / median step time, and MFU is
metrics.flops_per_token * tokens/s / metrics.peak_flops (the same FLOP count
for both models: they have the same shape). Data are random token ids: speed
does not depend on what the tokens say.

This is a benchmark, not a test: it asserts nothing about speed. Every flag of
train.py works (the model shape, --precision, --device, --threads ...); the
bench changes two defaults, --batch-size 8 and --steps 10 (timed steps per
model, after --warmup untimed ones).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from nanohlat import comm, config, metrics, optim, pipeline
from nanohlat import device as devicelib
from nanohlat import mesh as meshlib
from nanohlat.config import UserError
from nanohlat.model import Transformer, init_weights
from nanohlat.precision import param_dtype

BENCH_DEFAULTS = {"batch_size": 8, "steps": 10}


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


def nanohlat_step(model_cfg, tcfg, dev, tokens, targets):
    """nanohlat's single-process training step, as train.py runs it. Returns (step, model)."""
    mesh = meshlib.Mesh(1, 1, 1, ledger=comm.CommLedger())
    model = Transformer(model_cfg)
    init_weights(model, tcfg.seed)
    dtype = param_dtype(tcfg.precision)
    model.to(device=dev.torch_device, dtype=dtype)
    model.set_activation_checkpointing(tcfg.activation_checkpointing, dev.checkpoint)
    B, T = tokens.shape
    runner = pipeline.PipelineRunner(model, mesh, tcfg, (B, T, model_cfg.d_model), dtype, dev)
    opt = optim.FlatAdamW(model, mesh, tcfg, dev)
    tokens, targets = [tokens], [targets]   # one micro-batch

    def step():
        t0 = time.perf_counter()
        opt.zero_grad()
        runner.run(tokens, targets, 1.0 / (B * T))
        t1 = mark(dev)
        opt.step(tcfg.lr)
        dev.sync()
        return t1 - t0 if t1 else None

    return step, model


def hf_step(model_cfg, tcfg, dev, tokens, targets):
    """The same step for transformers' LlamaForCausalLM + torch.optim.AdamW, or
    None when transformers is not installed."""
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
    # weight decay on matrices only, as nanohlat (and HF's Trainer) do
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tcfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), eps=tcfg.adam_eps)
    V = model_cfg.padded_vocab

    def step():
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=tokens).logits                              # (B, T, V)
        loss = F.cross_entropy(logits.float().view(-1, V), targets.reshape(-1))
        loss.backward()
        t1 = mark(dev)
        torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
        opt.step()
        dev.sync()
        return t1 - t0 if t1 else None

    return step, model


def time_interleaved(steps: dict, n: int, warmup: int, dev) -> tuple[dict, dict]:
    """Seconds per step of each named step function, alternating them step by
    step (and who goes first, every round) so machine load falls on all alike.
    Returns ({name: [step seconds]}, {name: [forward + backward seconds]})."""
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    wait(dev)
    times = {name: [] for name in names}
    fwd_bwd = {name: [] for name in names}
    for i in range(n):
        for name in (names if i % 2 == 0 else names[::-1]):
            wait(dev)
            t0 = time.perf_counter()
            fb = steps[name]()
            wait(dev)
            times[name].append(time.perf_counter() - t0)
            if fb is not None:
                fwd_bwd[name].append(fb)
    return times, fwd_bwd


def profile(steps: dict, dev, n: int = 3, rows: int = 25) -> str:
    """torch.profiler's op table (self time) for n steps of each model."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.kind == "cuda" else [])
    sort = "self_cuda_time_total" if dev.kind == "cuda" else "self_cpu_time_total"
    out = []
    for name, step in steps.items():
        with torch_profile(activities=activities) as prof:
            for _ in range(n):
                step()
            wait(dev)
        out.append(f"\n=== {name}: {n} steps, ops by self time ===")
        out.append(prof.key_averages().table(sort_by=sort, row_limit=rows))
    return "\n".join(out)


def parse(argv):
    """train.py's flags (model shape, precision, device ...) plus the bench's own."""
    parser = config.build_parser("Time nanohlat's training step (and Hugging Face Llama's) on this machine.")
    b = parser.add_argument_group("bench")
    b.add_argument("--warmup", type=int, default=2, help="untimed steps per model first (default 2)")
    b.add_argument("--no-hf", dest="hf", action="store_false", default=True,
                   help="skip the Hugging Face comparison")
    b.add_argument("--profile", action="store_true", default=False,
                   help="also print torch.profiler's top ops for each model")
    flags = vars(parser.parse_args(argv))
    own = {k: flags.pop(k) for k in ("warmup", "hf", "profile")}
    flags = BENCH_DEFAULTS | flags
    model_cfg, tcfg = config.resolve(flags)
    if tcfg.pp != 1 or tcfg.tp != 1 or tcfg.microbatches != 1:
        raise UserError("the bench times one process: leave --tp, --pp and --microbatches at 1")
    return model_cfg, tcfg, argparse.Namespace(**own)


def main(argv=None) -> int:
    try:
        model_cfg, tcfg, args = parse(sys.argv[1:] if argv is None else argv)
        dev = devicelib.get_device(tcfg.device)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if dev.kind == "cpu":
        devicelib.set_cpu_threads(tcfg.threads or os.cpu_count() or 1)
    threads = torch.get_num_threads() if dev.kind == "cpu" else None
    tokens, targets = random_batch(model_cfg, tcfg, dev)

    steps, models = {}, {}
    steps["nanohlat"], models["nanohlat"] = nanohlat_step(model_cfg, tcfg, dev, tokens, targets)
    hf = hf_step(model_cfg, tcfg, dev, tokens, targets) if args.hf else None
    if hf is not None:
        steps["hf-llama"], models["hf-llama"] = hf
        n_ours, n_hf = (sum(p.numel() for p in m.parameters()) for m in models.values())
        assert n_ours == n_hf, f"shape mismatch: nanohlat {n_ours:,} vs Hugging Face {n_hf:,} parameters"
    elif args.hf:
        print("(transformers is not installed: timing nanohlat alone; pip install transformers)")

    tok_per_step = tcfg.batch_size * tcfg.seq_len
    flops_tok = metrics.flops_per_token(model_cfg, tcfg.seq_len)
    peak = metrics.measure_cpu_peak() if dev.kind == "cpu" else metrics.peak_flops(dev.name, tcfg.precision)
    where = f"{dev.name} ({threads} threads)" if threads else dev.name
    print(f"model: {model_cfg.n_layers} layers, d_model {model_cfg.d_model}, {model_cfg.n_heads} heads "
          f"({model_cfg.n_kv_heads} kv), ffn {model_cfg.ffn_dim}, vocab {model_cfg.padded_vocab}: "
          f"{model_cfg.num_params() / 1e6:.2f}M parameters, {flops_tok / 1e6:.1f} MFLOP/token")
    peak_text = f"peak {peak / 1e9:,.0f} GFLOP/s" if peak else "peak unknown (no MFU)"
    print(f"step: batch {tcfg.batch_size} x seq {tcfg.seq_len} = {tok_per_step:,} tokens, {tcfg.precision}, "
          f"on {where}; {peak_text}")
    print(f"timing {tcfg.steps} steps per model after {args.warmup} warm-up, interleaved ...", flush=True)

    times, fwd_bwd = time_interleaved(steps, tcfg.steps, args.warmup, dev)
    rate = {}
    # fwd+bwd and optimizer: medians of each phase (they need not add up to the step's median)
    print(f"\n{'':<10} {'median step':>12} {'min':>9} {'max':>9} {'tokens/s':>10} {'MFU':>7} "
          f"{'fwd+bwd':>10} {'optimizer':>10}")
    for name, ts in times.items():
        med = statistics.median(ts)
        rate[name] = tok_per_step / med
        m = metrics.mfu(rate[name], flops_tok, peak)
        mfu_text = f"{m * 100:6.1f}%" if m is not None else "    n/a"
        phases = ""
        if fwd_bwd[name]:
            fb = statistics.median(fwd_bwd[name])
            op = statistics.median([t - f for t, f in zip(ts, fwd_bwd[name])])
            phases = f" {fb * 1e3:>7.1f} ms {op * 1e3:>7.1f} ms"
        print(f"{name:<10} {med * 1e3:>9.1f} ms {min(ts) * 1e3:>6.1f} ms {max(ts) * 1e3:>6.1f} ms "
              f"{rate[name]:>10,.0f} {mfu_text}{phases}")
    if "hf-llama" in rate:
        print(f"\nnanohlat / hf-llama tokens/s: {rate['nanohlat'] / rate['hf-llama']:.3f}x")
    if args.profile:
        print(profile(steps, dev))
    return 0


if __name__ == "__main__":
    sys.exit(main())
