"""The bench's reference for a mixture of experts: Hugging Face's MixtralForCausalLM.

A dense model is timed beside Hugging Face's LlamaForCausalLM (bench.hf_step);
a mixture of experts beside MixtralForCausalLM of the same shape: the same
layers, E experts of width --ffn-dim, top-k routing with the k probabilities
renormalised, no shared experts, every layer sparse, no dropped tokens (the
shapes Mixtral has: serving/hf.py's export refuses the others, and so does
this comparison). It starts from nanohlat's own initial weights, carried over
by the export mapping (serving/hf.py: to_hf_config, to_hf_state), so the two
first steps see the same model on the same batch: their language-model losses
must agree to fp32 round-off (`check_first_losses`), which shows that the
step being timed is the same computation.

Each step: forward, cross-entropy over the real vocabulary, plus Mixtral's
load-balancing loss times --moe-aux-coef (its router_aux_loss_coef, over the
whole batch; nanohlat's is per sequence and adds a small z-loss: router work of
a few (N, E) tensors either way), backward, clip_grad_norm_ and
torch.optim.AdamW, fused (`hf_adamw`), as for Llama; with `compile`, the model
through torch.compile. Hugging Face computes the experts the way it
chooses by default (config._experts_implementation, printed; in transformers 5
one grouped matmul over the tokens sorted by expert where torch has one).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from nanohlat.config import UserError
from nanohlat.model import init_weights
from nanohlat.precision import param_dtype
from nanohlat.run.build import decoder

NAME = "hf-mixtral"
TOLERANCE = 1e-5   # first-step losses, fp32: the same weights, tokens and arithmetic up to round-off


def initial_state(model_cfg, tcfg) -> dict:
    """nanohlat's initial weights, full, fp32: those build() gives the timed model (init_weights, same seed)."""
    model = decoder(model_cfg)
    init_weights(model, tcfg.seed)
    return {n: t.detach() for n, t in model.state_dict().items()}


def loadable(hf_state: dict, wanted: dict) -> dict:
    """The exported state (Mistral's per-expert layout: experts.{j}.w1/w3/w2, the router
    block_sparse_moe.gate) in the layout of the model built here, `wanted` its state_dict.
    transformers 5 holds each layer's experts fused: mlp.experts.gate_up_proj (E, 2F, C),
    every expert's w1 (gate) rows then its w3 (up) rows, and mlp.experts.down_proj (E, C, F),
    the w2s; the router is mlp.gate. Older versions keep the exported names."""
    if set(hf_state) == set(wanted):
        return hf_state
    out = {n: t for n, t in hf_state.items() if ".block_sparse_moe." not in n}
    layers = sorted({int(n.split(".")[2]) for n in hf_state if ".block_sparse_moe." in n})
    for i in layers:
        moe = f"model.layers.{i}.block_sparse_moe"
        E = sum(1 for n in hf_state if n.startswith(f"{moe}.experts.") and n.endswith(".w1.weight"))
        w = {j: {m: hf_state[f"{moe}.experts.{j}.{m}.weight"] for m in ("w1", "w2", "w3")} for j in range(E)}
        out[f"model.layers.{i}.mlp.gate.weight"] = hf_state[f"{moe}.gate.weight"]
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([w[j]["w1"], w[j]["w3"]])
                                                                         for j in range(E)])
        out[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack([w[j]["w2"] for j in range(E)])
    return out


def fastest_adamw(device: torch.device, dtype: torch.dtype) -> str:
    """'fused' where torch has a fused AdamW kernel for this device and dtype (the CPU's since torch
    2.4, CUDA's), else 'foreach' (one kernel per op over all tensors, not one per tensor): what a user
    who wants the fastest torch.optim.AdamW picks. Asked of torch itself, by one step of a
    one-element parameter: which devices have the kernel is private to torch and moves between
    versions."""
    p = torch.nn.Parameter(torch.zeros(1, device=device, dtype=dtype))
    p.grad = torch.zeros_like(p)
    try:
        torch.optim.AdamW([p], fused=True).step()
    except RuntimeError:
        return "foreach"
    return "fused"


def hf_adamw(model, tcfg):
    """torch.optim.AdamW for a Hugging Face reference model, set as nanohlat's: weight decay on
    matrices only (as nanohlat, and HF's Trainer, do), the recipe's lr, betas and eps; and the
    fastest implementation torch has for the model's device and dtype (`fastest_adamw`: fused on
    the CPU and CUDA), not torch's default (on the CPU, a loop over the tensors). Its kind is
    `adamw_kind(opt)`."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    p0 = next(model.parameters())
    kind = fastest_adamw(p0.device, p0.dtype)
    return torch.optim.AdamW([{"params": decay, "weight_decay": tcfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), eps=tcfg.adam_eps,
                             **{kind: True})


def adamw_kind(opt) -> str:
    """'fused', 'foreach' or 'for-loop': which implementation a torch.optim.AdamW runs."""
    return "fused" if opt.defaults.get("fused") else "foreach" if opt.defaults.get("foreach") else "for-loop"


def hf_mixtral_step(model_cfg, tcfg, dev, tokens, targets, mark, timed, compile: bool = False):
    """Hugging Face's MixtralForCausalLM step from nanohlat's initial weights: (step, model), the step
    a `timed` (bench.Timed: its first_loss the first step's language-model loss; its `opt` the
    optimizer); the model's forward through torch.compile with `compile`; None without transformers.
    UserError for a mixture Mixtral cannot express (serving/hf.py's check_mixtral; --moe-bias-rate)."""
    if model_cfg.moe_bias_rate:   # (it was a KeyError: 'mlp.expert_bias', in to_hf_state)
        raise UserError(f"--moe-bias-rate {model_cfg.moe_bias_rate:g} moves a bias per expert after each step, "
                        f"which Mixtral's router has not: from the second step the two would route tokens apart")
    try:
        from transformers import MixtralConfig, MixtralForCausalLM
    except ImportError:
        return None
    from nanohlat.serving import hf as hflib
    # (to_hf_config: UserError for shared experts, --moe-every or capacity mode, which Mixtral has not)
    config = MixtralConfig(**hflib.to_hf_config(model_cfg), attn_implementation="sdpa")
    config.output_router_logits = True                          # its load-balancing loss, as nanohlat trains one
    model = MixtralForCausalLM(config)
    state = loadable(hflib.to_hf_state(model_cfg, initial_state(model_cfg, tcfg)), model.state_dict())
    model.load_state_dict(state, strict=True)
    model = model.to(device=dev.torch_device, dtype=param_dtype(tcfg.precision))
    model.train()
    opt = hf_adamw(model, tcfg)
    V, coef = model_cfg.vocab_size, config.router_aux_loss_coef   # (mark: bench.mark, the end of fwd + bwd)
    forward = torch.compile(model) if compile else model

    def step():
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        out = forward(input_ids=tokens)
        lm = F.cross_entropy(out.logits.float().view(-1, V), targets.reshape(-1))
        (lm + coef * out.aux_loss).backward()
        t1 = mark(dev)
        torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
        opt.step()
        dev.sync()
        return (t1 - t0 if t1 else None), lm.detach()

    return timed(step, opt), model


def experts_implementation(model) -> str:
    """How the Hugging Face model computes its experts ('eager' where transformers has no choice)."""
    return str(getattr(model.config, "_experts_implementation", None) or "eager")


def first_losses(ours, theirs, precision: str) -> tuple[str, bool]:
    """(the line comparing the first step's losses, whether they agree): within TOLERANCE in
    fp32; in lower precisions the line is printed and not judged (round-off is larger there)."""
    a, b = float(ours), float(theirs)
    line = f"first-step loss from the same initial weights: nanohlat {a:.7f}, {NAME} {b:.7f}, |diff| {abs(a - b):.1e}"
    if precision != "fp32":
        return line + f" ({precision}: not checked)", True
    ok = abs(a - b) <= TOLERANCE
    return line + (f" <= {TOLERANCE:g}" if ok else f" > {TOLERANCE:g}: not the same model, the comparison is void"), ok
