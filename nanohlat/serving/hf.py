"""Hugging Face Llama (and Mixtral) <-> nanohlat checkpoints.

    python -m nanohlat.hf export RUN_OR_CKPT HF_DIR    # -> LlamaForCausalLM.from_pretrained(HF_DIR)
                                                       #    (a mixture of experts: MixtralForCausalLM)
    python -m nanohlat.hf import HF_DIR OUT_DIR        # -> train.py --resume OUT_DIR/..., sample.py, eval.py

Neither writes into a folder that already holds something unless told
--overwrite (import then replaces the run in OUT_DIR, as train.py
--resume never --overwrite does), and import takes OUT_DIR's run lock.

nanohlat's decoder *is* the Llama architecture, and its rotary embedding uses
Hugging Face's rotate-half convention, so every weight maps 1:1 without the
q/k row permutation that converting Meta's original checkpoints needs:

    nanohlat                         Hugging Face LlamaForCausalLM
    embed.weight                     model.embed_tokens.weight
    layers.{i}.attn_norm.weight      model.layers.{i}.input_layernorm.weight
    layers.{i}.attn.w{q,k,v,o}       model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    layers.{i}.mlp_norm.weight       model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.mlp.{gate,up,down}    model.layers.{i}.mlp.{gate,up,down}_proj.weight
    norm.weight                      model.norm.weight
    head.weight                      lm_head.weight

A mixture of experts (nanohlat/beyond/moe.py) exports as MixtralForCausalLM, and a
Mixtral folder imports as one. Mixtral's sparse block is nanohlat's MoE:
its router is one linear layer without bias, a softmax over the E experts in
fp32, the top k, their probabilities renormalised over the k (moe.route; the
one difference: nanohlat computes the router's logits in fp32 too, Mixtral
in the model's dtype, the same for an fp32 model); each expert is the same
SwiGLU, and the output is the weighted sum. Mixtral has no shared experts, no
dense layers between sparse ones and never drops a token, so export refuses
--moe-shared-experts, --moe-every > 1 and --moe-capacity-factor > 0 (the
weights would compute otherwise there). Nor has Mixtral's router a bias: a
model trained with --moe-bias-rate chose its experts by p + its biases
(moe.route), so export refuses it once a bias is not zero (Mixtral would route
its tokens to other experts), and leaves the all-zero biases out. The attention, norms, embedding and
head map as for Llama; in layer i, nanohlat's experts are stacked (E, ...)
tensors and Mixtral's are one tensor per expert j:

    layers.{i}.mlp.router.weight     model.layers.{i}.block_sparse_moe.gate.weight
    layers.{i}.mlp.gate.weight[j]    model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight
    layers.{i}.mlp.up.weight[j]      model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight
    layers.{i}.mlp.down.weight[j]    model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight

(the layout of Mistral's released checkpoints, which transformers 5 fuses into
its own on loading). The z-loss coefficient has no Mixtral field and imports
as nanohlat's default. The balance loss differs on each side (`mixtral_aux_coef`):
nanohlat's is coef x the sum over sparse layers of the mean over sequences of
E sum_e f_e P_e (f_e: the share of a sequence's T*k choices); transformers' is
router_aux_loss_coef x E sum_e F_e P_e over one pool of all layers' and sequences'
tokens, F_e = tokens choosing e / tokens (summing to k). Export writes coef x L / k
(L layers, all sparse), import divides back: equal on one sequence of a one-layer
model (tests/serving/test_hf.py), else alike in magnitude only, as export says.

For both, one difference is the vocabulary padding (docs/design.md 5.3): nanohlat's embed
and head have cfg.padded_vocab rows, Hugging Face's have exactly vocab_size.
Export slices the padding rows off; import adds zero rows.

`transformers` is not needed here (config.json is plain JSON); `safetensors`
is needed to write or read model.safetensors (`pip install safetensors`).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import sys

import torch

from nanohlat.config import UserError
from nanohlat.recipe import ModelConfig
from nanohlat.system import cli, files, flags
from nanohlat.serving.hf_files import (EXPORT_FILES, _move_into, _partial_dir, _refuse_non_empty,  # noqa: F401
                                     _safetensors, read_hf_config, read_hf_dir, read_hf_weights)

# nanohlat name suffix <-> Hugging Face name suffix, inside layer i.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "head.weight": "lm_head.weight"}
_VOCAB_NAMES = ("embed.weight", "head.weight")   # padded_vocab rows here, vocab_size there


# In a sparse layer (Mixtral): the router is the sparse block's gate, and each stacked
# (E, ...) expert matrix is E matrices, experts.{j}.w1 (gate), w3 (up) and w2 (down).
_MOE_NAMES = {"mlp.router.weight": "block_sparse_moe.gate.weight", "mlp.gate.weight": "w1.weight",
              "mlp.up.weight": "w3.weight", "mlp.down.weight": "w2.weight"}


def experts_stacked(cfg: ModelConfig, name: str) -> bool:
    """Whether a nanohlat parameter holds a sparse layer's E experts stacked (E, ...)."""
    parts = name.split(".", 2)
    return (parts[0] == "layers" and cfg.is_moe_layer(int(parts[1]))
            and parts[2] in _MOE_NAMES and parts[2] != "mlp.router.weight")


def hf_names(cfg: ModelConfig, name: str) -> list[str]:
    """The Hugging Face name(s) of a nanohlat parameter: one, or, for stacked
    experts (experts_stacked), E of them: expert j's at j."""
    if name in _TOP_NAMES:
        return [_TOP_NAMES[name]]
    _, i, rest = name.split(".", 2)                     # "layers", "7", "attn.wq.weight"
    if experts_stacked(cfg, name):
        return [f"model.layers.{i}.block_sparse_moe.experts.{j}.{_MOE_NAMES[rest]}" for j in range(cfg.moe_experts)]
    if cfg.is_moe_layer(int(i)) and rest in _MOE_NAMES:   # the router
        return [f"model.layers.{i}.{_MOE_NAMES[rest]}"]
    return [f"model.layers.{i}.{_LAYER_NAMES[rest]}"]


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """Every nanohlat parameter name -> its full (unsharded) shape."""
    d, kv, f = cfg.d_model, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
    shapes = {"embed.weight": (cfg.padded_vocab, d), "norm.weight": (d,), "head.weight": (cfg.padded_vocab, d)}
    for i in range(cfg.n_layers):
        shapes.update({f"layers.{i}.attn_norm.weight": (d,), f"layers.{i}.mlp_norm.weight": (d,),
                       f"layers.{i}.attn.wq.weight": (cfg.n_heads * cfg.head_dim, d),
                       f"layers.{i}.attn.wk.weight": (kv, d), f"layers.{i}.attn.wv.weight": (kv, d),
                       f"layers.{i}.attn.wo.weight": (d, cfg.n_heads * cfg.head_dim)})
        E = (cfg.moe_experts,) if cfg.is_moe_layer(i) else ()    # a sparse layer: E experts stacked, a router
        shapes.update({f"layers.{i}.mlp.gate.weight": (*E, f, d), f"layers.{i}.mlp.up.weight": (*E, f, d),
                       f"layers.{i}.mlp.down.weight": (*E, d, f)})
        if E:
            shapes[f"layers.{i}.mlp.router.weight"] = (cfg.moe_experts, d)
    return shapes


def check_mixtral(cfg: ModelConfig) -> None:
    """A mixture of experts exports as Mixtral only in Mixtral's shape (UserError otherwise)."""
    if cfg.moe_experts and (cfg.moe_shared_experts or cfg.moe_every != 1 or cfg.moe_capacity_factor):
        raise UserError(f"this mixture of experts (--moe-shared-experts {cfg.moe_shared_experts}, --moe-every "
                        f"{cfg.moe_every}, --moe-capacity-factor {cfg.moe_capacity_factor:g}) has no Hugging Face "
                        f"equivalent: Mixtral has no shared experts, every layer sparse and no dropped tokens "
                        f"(0, 1 and 0); only such a model exports")


# ---------------------------------------------------------------------------
# Pure conversions (no files)
# ---------------------------------------------------------------------------

def to_hf_config(cfg: ModelConfig, bos_id: int = 1, eos_id: int = 2, dtype: str = "float32") -> dict:
    """config.json of the equivalent LlamaForCausalLM (MixtralForCausalLM: a mixture of experts)."""
    check_mixtral(cfg)
    common = {
        "vocab_size": cfg.vocab_size,                   # unpadded: the padding rows are not exported
        "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        # transformers < 5 reads rope_theta, >= 5 rope_parameters (and still accepts the former)
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None, "hidden_act": "silu", "tie_word_embeddings": False,
        "attention_dropout": 0.0, "initializer_range": 0.02,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "use_cache": True, "torch_dtype": dtype,
    }
    if cfg.moe_experts:   # Mixtral: (intermediate_size is one expert's), full attention, no router noise
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **common,
                "num_local_experts": cfg.moe_experts, "num_experts_per_tok": cfg.moe_top_k,
                "router_aux_loss_coef": mixtral_aux_coef(cfg), "output_router_logits": False,
                "router_jitter_noise": 0.0, "sliding_window": None}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
            "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}


def mixtral_aux_coef(cfg: ModelConfig) -> float:
    """transformers' router_aux_loss_coef for --moe-aux-coef: L / k times it (module docstring)."""
    return cfg.moe_aux_coef * cfg.n_layers / cfg.moe_top_k


def to_hf_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """nanohlat full state -> Hugging Face Llama (or Mixtral) state (vocabulary padding removed)."""
    missing = set(expected_shapes(cfg)) - set(state)
    if missing:
        raise UserError(f"the nanohlat state lacks {len(missing)} parameters, e.g. {sorted(missing)[:3]}; "
                        f"export needs a complete single-model state")
    out = {}
    for name, t in state.items():
        if name in _VOCAB_NAMES:
            t = t[:cfg.vocab_size]
        names = hf_names(cfg, name)
        parts = t.unbind(0) if experts_stacked(cfg, name) else (t,)   # expert j's matrix is t[j]
        # safetensors refuses views of a larger buffer and tensors sharing memory: own copies.
        out.update({n: p.detach().contiguous().clone() for n, p in zip(names, parts)})
    return out


def _rope_theta(hf_config: dict) -> float:
    params = hf_config.get("rope_parameters") or {}
    scaling = hf_config.get("rope_scaling") or {}
    kinds = {params.get("rope_type"), scaling.get("rope_type"), scaling.get("type")} - {None, "default"}
    if kinds:
        raise UserError(f"rope type {kinds.pop()!r} (rope scaling, as in Llama 3.1+) is not supported: "
                        f"nanohlat implements plain rotary embeddings only")
    theta = params.get("rope_theta", hf_config.get("rope_theta"))
    if theta is not None and not (isinstance(theta, (int, float)) and not isinstance(theta, bool)):
        raise UserError(f"config.json's rope_theta is {theta!r}, not a number; fix the file, or give another "
                        f"model directory")
    return float(theta if theta is not None else 10000.0)


def _vocab_multiple(vocab_size: int) -> int:
    """128 (the default, divisible by every tp we allow) when it divides the vocabulary, else the
    largest power of two that does: no padding rows, at the price of fewer valid tp degrees."""
    m = 128
    while vocab_size % m:
        m //= 2
    return m


def _or(value, default):
    """`value`, or `default` when config.json leaves it out (null): never when it is 0, which is refused."""
    return default if value is None else value


def from_hf_config(hf_config: dict, vocab_multiple: int | None = None) -> ModelConfig:
    """Hugging Face Llama (or Mixtral) config.json dict -> the ModelConfig of the same
    model (checked: each field nanohlat reads for its type first, then the model's ranges)."""
    def bad(key: str, want: str) -> UserError:
        return UserError(f"config.json's {key} is {hf_config.get(key)!r}, not {want}; it is not a complete "
                         f"{kind} config (fix the file, or give another model directory)")

    def whole(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)
    kind = "Llama"
    if not isinstance(hf_config.get("architectures") or [], list):
        raise bad("architectures", "a list of class names")
    arch = hf_config.get("model_type") or "?"
    mixtral = arch == "mixtral" or "MixtralForCausalLM" in (hf_config.get("architectures") or [])
    kind = "Mixtral" if mixtral else kind
    if arch != "llama" and "LlamaForCausalLM" not in (hf_config.get("architectures") or []) and not mixtral:
        raise UserError(f"model_type {arch!r} is not Llama; only LlamaForCausalLM (and MixtralForCausalLM) "
                        f"checkpoints convert 1:1")
    moe = _mixtral_fields(hf_config, bad, whole) if mixtral else {}
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf_config.get(key, want) != want:
            raise UserError(f"{key} = {hf_config[key]!r} is not supported (nanohlat's Llama has {key} = {want!r})")
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"):
        if not whole(hf_config.get(key)):
            raise UserError(f"config.json has no integer {key!r} (got {hf_config.get(key)!r}); "
                            f"it is not a complete {kind} config")
    for key in ("num_key_value_heads", "max_position_embeddings", "head_dim"):   # optional: null is the default
        if hf_config.get(key) is not None and not whole(hf_config[key]):
            raise bad(key, "a whole number")
    for key in ("rms_norm_eps", "rope_theta"):
        v = hf_config.get(key)
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
            raise bad(key, "a finite number")
    for key in ("rope_parameters", "rope_scaling"):
        if not isinstance(hf_config.get(key) or {}, dict):
            raise bad(key, "a record or null")
    if not isinstance(hf_config.get("tie_word_embeddings", False), bool):
        raise bad("tie_word_embeddings", "true or false")
    vocab = hf_config["vocab_size"]
    cfg = ModelConfig(n_layers=hf_config["num_hidden_layers"], d_model=hf_config["hidden_size"],
                      n_heads=hf_config["num_attention_heads"],
                      n_kv_heads=hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"],
                      ffn_dim=hf_config["intermediate_size"], vocab_size=vocab,
                      max_seq_len=_or(hf_config.get("max_position_embeddings"), 2048),
                      rope_theta=_rope_theta(hf_config), norm_eps=_or(hf_config.get("rms_norm_eps"), 1e-5),
                      vocab_multiple=vocab_multiple or _vocab_multiple(vocab), **moe)
    try:
        cfg.validate()   # (positive sizes before any division: a head count of 0 was a ZeroDivisionError)
    except UserError as e:
        raise UserError(f"config.json describes no valid model: {e}") from None
    if hf_config.get("head_dim") not in (None, cfg.head_dim):
        raise UserError(f"head_dim {hf_config['head_dim']} != hidden_size / num_attention_heads = {cfg.head_dim}; "
                        f"nanohlat derives the head size from d_model")
    return cfg


def _mixtral_fields(hf_config: dict, bad, whole) -> dict:   # (the coefficient: mixtral_aux_coef, inverted)
    """The ModelConfig fields of a Mixtral config.json's mixture of experts (every layer
    sparse, no shared experts, dropless). Its attention must be full (no sliding window)
    and its router without noise, as nanohlat's."""
    for key in ("num_local_experts", "num_experts_per_tok"):
        if not whole(hf_config.get(key)):
            raise bad(key, "a whole number")
    for key, want in (("sliding_window", None), ("router_jitter_noise", 0)):
        if hf_config.get(key) not in (None, want):
            raise UserError(f"config.json's {key} is {hf_config[key]!r}, which nanohlat does not support (its "
                            f"mixture of experts has {key} {want!r}: full attention, a router without noise)")
    aux = hf_config.get("router_aux_loss_coef")
    if aux is not None and not (isinstance(aux, (int, float)) and not isinstance(aux, bool) and math.isfinite(aux)):
        raise bad("router_aux_loss_coef", "a finite number")
    k, layers = hf_config["num_experts_per_tok"], hf_config.get("num_hidden_layers")
    layers = layers if whole(layers) else 1   # (a bad num_hidden_layers is refused with the other fields)
    return {"moe_experts": hf_config["num_local_experts"], "moe_top_k": k,
            "moe_aux_coef": float(_or(aux, 0.001)) * k / layers}   # (0.001: transformers' default)


def from_hf_state(hf_config: dict, hf_state: dict[str, torch.Tensor], vocab_multiple: int | None = None,
                  origin: dict[str, str] | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Hugging Face Llama (or Mixtral) config.json dict + state -> (ModelConfig,
    nanohlat full fp32 state). Mixtral's state as its checkpoints store it (the
    module docstring), which transformers' save_pretrained writes. Every tensor is
    checked: its name, its shape, its values finite. `origin` (read_hf_weights):
    the file each came from, named in a refusal."""
    where = lambda h: (origin or {}).get(h) or ", ".join(sorted(set((origin or {}).values()))) or "the weights"   # noqa: E731
    cfg = from_hf_config(hf_config, vocab_multiple)
    d = cfg.d_model
    hf_state = {k: v for k, v in hf_state.items() if not k.endswith("rotary_emb.inv_freq")}  # old, derived
    if "lm_head.weight" not in hf_state and hf_config.get("tie_word_embeddings"):
        hf_state["lm_head.weight"] = hf_state["model.embed_tokens.weight"]   # untied from here on
    shapes = expected_shapes(cfg)
    wanted = {n: hf_names(cfg, n) for n in shapes}
    every = {h for names in wanted.values() for h in names}
    missing, unexpected = every - set(hf_state), set(hf_state) - every
    if missing or unexpected:
        raise UserError(f"{where(None)}: not a {'Mixtral' if cfg.moe_experts else 'Llama'} state of its config.json "
                        f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
    state = {}
    for name, hnames in wanted.items():
        stacked = experts_stacked(cfg, name)
        # what each Hugging Face tensor holds: one expert of a stack; the vocabulary unpadded
        want = shapes[name][1:] if stacked else (cfg.vocab_size, d) if name in _VOCAB_NAMES else shapes[name]
        for hname in hnames:
            if tuple(hf_state[hname].shape) != want:
                raise UserError(f"{where(hname)}: {hname} has shape {tuple(hf_state[hname].shape)}, expected {want} "
                                f"from config.json")
            if not bool(torch.isfinite(hf_state[hname]).all()):   # (as every reader of a checkpoint refuses them)
                raise UserError(f"{where(hname)} has non-finite weights (NaN or inf) in {hname}: it cannot be "
                                f"imported (nor sampled, evaluated or exported); fix the file or use another model")
        parts = [hf_state[h].detach().float() for h in hnames]   # nanohlat keeps fp32; bf16 widens exactly
        t = torch.stack(parts) if stacked else parts[0]          # expert j's matrix at j
        if name in _VOCAB_NAMES:
            t = torch.cat([t, t.new_zeros(cfg.padded_vocab - t.shape[0], d)])   # padding rows are zero
        state[name] = t.contiguous()
    return cfg, state


# ---------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------

def write_hf_dir(cfg: ModelConfig, state: dict[str, torch.Tensor], tokenizer_path: str, hf_dir: str) -> None:
    """config.json, model.safetensors, tokenizer.model and tokenizer_config.json in hf_dir."""
    from nanohlat.run.data import load_tokenizer
    tok = load_tokenizer(tokenizer_path)
    if tok.vocab_size > cfg.vocab_size:
        raise UserError(f"tokenizer {tokenizer_path!r} has {tok.vocab_size} pieces, more than the model's "
                        f"vocab_size {cfg.vocab_size}")
    st = _safetensors()
    os.makedirs(hf_dir, exist_ok=True)
    # Each file through files.atomic_write: whole or absent, and never written through a link.
    dtype = str(state["embed.weight"].dtype).removeprefix("torch.")     # float32, or bfloat16 (pure bf16)
    files.write_text(os.path.join(hf_dir, "config.json"),
                     files.json_text(to_hf_config(cfg, tok.bos_id, tok.eos_id, dtype), indent=2))
    weights = st.save(to_hf_state(cfg, state), metadata={"format": "pt"})
    files.atomic_write(os.path.join(hf_dir, "model.safetensors"), lambda f: f.write(weights))
    files.copy_file(tokenizer_path, os.path.join(hf_dir, "tokenizer.model"))
    piece = tok.sp.id_to_piece
    tok_config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": piece(tok.bos_id), "eos_token": piece(tok.eos_id),
        "unk_token": piece(tok.sp.unk_id()) if tok.sp.unk_id() >= 0 else None,
        "add_bos_token": True, "add_eos_token": False,   # as nanohlat packs documents: BOS text EOS
        # nanohlat's tokenizer has no dummy prefix: "def" is not "▁def"
        "add_prefix_space": False, "legacy": False,
        "clean_up_tokenization_spaces": False, "model_max_length": cfg.max_seq_len,
    }
    files.write_text(os.path.join(hf_dir, "tokenizer_config.json"), files.json_text(tok_config, indent=2))


def export(run_or_ckpt: str, hf_dir: str, overwrite: bool = False) -> None:
    from nanohlat.device import get_device
    from nanohlat.serving.generate import load_model
    _refuse_non_empty(hf_dir, "HF_DIR", overwrite)
    for name in EXPORT_FILES:   # (--overwrite: a FIFO or a device there would be replaced by the file)
        files.refuse_unless_file(os.path.join(hf_dir, name), "another HF_DIR")
    # its config and finite weights checked, and that three copies of the weights fit
    # (the model, its state cut for HF, the file's bytes)
    model, manifest = load_model(run_or_ckpt, get_device("cpu"), copies=3)
    check_mixtral(model.cfg)    # before anything is written
    state = model.state_dict()
    biases = [n for n in state if n.endswith(".expert_bias")]   # --moe-bias-rate's (module docstring)
    moved = [n for n in biases if bool(state[n].any())]
    if moved:
        raise UserError(f"{run_or_ckpt} trained with --moe-bias-rate and its expert biases are not zero ({moved[0]} "
                        f"and {len(moved) - 1} more): Mixtral's router has no bias, so the exported model would "
                        f"send tokens to other experts than this one does; nothing was written (export a model "
                        f"balanced by --moe-aux-coef instead)")
    state = {n: t for n, t in state.items() if n not in biases}
    # Into a temporary folder beside HF_DIR, moved into place once every file is whole: a
    # full disk (or Ctrl-C) leaves HF_DIR as it was, never config.json without its weights.
    tmp = _partial_dir(hf_dir)
    try:
        write_hf_dir(model.cfg, state, manifest["tokenizer"], tmp)
        _move_into(tmp, hf_dir)
    except OSError as e:
        raise UserError(f"{files.os_error_message(e)} (the export is written there first; it was removed and "
                        f"{hf_dir!r} left as it was)") from None
    finally:
        if os.path.isdir(tmp) and not os.path.islink(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"exported step {manifest.get('step')} of {run_or_ckpt} -> {hf_dir} "
          f"({'MixtralForCausalLM' if model.cfg.moe_experts else 'LlamaForCausalLM'}, vocab {model.cfg.vocab_size}, "
          f"{sum(v.numel() for v in state.values()):,} params)")
    if (cfg := model.cfg).moe_experts:
        print(f"router_aux_loss_coef {mixtral_aux_coef(cfg):g} = --moe-aux-coef {cfg.moe_aux_coef:g} x {cfg.n_layers} "
              f"layers / top-{cfg.moe_top_k}: transformers pools every layer's and sequence's tokens into one balance "
              f"loss where nanohlat sums a per-sequence one per layer, so they match in magnitude, exactly on one "
              f"sequence of a one-layer model (nanohlat/serving/hf.py)")


def import_(hf_dir: str, out_dir: str, tokenizer: str = "", vocab_multiple: int | None = None,
            overwrite: bool = False) -> str:
    from nanohlat.run.checkpoint import clear_run, save_full
    from nanohlat.run.runlock import acquire, check_out_dir
    if not os.path.isdir(hf_dir):
        raise UserError(f"{hf_dir!r} {'is not a folder' if os.path.exists(hf_dir) else 'does not exist'}; give "
                        f"the folder of a Hugging Face LLaMA checkpoint (config.json, *.safetensors, tokenizer.model)")
    _refuse_non_empty(out_dir, "OUT_DIR", overwrite)
    check_out_dir(out_dir)   # (a FIFO or a device at one of a run's files: before any work)
    tokenizer = tokenizer or os.path.join(hf_dir, "tokenizer.model")
    if not os.path.isfile(tokenizer):
        raise UserError(f"{hf_dir!r} has no SentencePiece tokenizer.model (nanohlat tokenises with "
                        f"SentencePiece; a tokenizer.json-only model such as Llama 3 is not supported); "
                        f"pass --tokenizer PATH")
    hf_config = read_hf_config(hf_dir)
    from nanohlat.run.runconfig import check_fits   # before the weights are read: as read, and as fp32
    try:
        cfg = from_hf_config(hf_config, vocab_multiple)
    except UserError as e:   # named with its folder: config.json alone says not which one
        path = os.path.join(hf_dir, "config.json")
        raise UserError(f"{path[:-11]}{e}" if str(e).startswith("config.json") else f"{path}: {e}") from None
    check_fits(cfg, "cpu", os.path.join(hf_dir, "config.json"), copies=2, ranks=0)
    origin: dict[str, str] = {}
    cfg, state = from_hf_state(hf_config, read_hf_weights(hf_dir, origin), vocab_multiple, origin)
    from nanohlat.run.data import load_tokenizer
    if load_tokenizer(tokenizer).vocab_size > cfg.vocab_size:
        raise UserError(f"tokenizer {tokenizer!r} has more pieces than the model's vocab_size {cfg.vocab_size}")
    lock = acquire(out_dir)     # no training run may be writing there meanwhile
    kept = os.path.abspath(os.path.join(out_dir, "tokenizer.model"))
    copied = False
    try:
        if overwrite:
            clear_run(out_dir)
        # The checkpoint records the tokenizer's path: keep a copy in the run, so it
        # outlives (and does not depend on) the Hugging Face directory.
        if os.path.abspath(tokenizer) != kept:
            files.copy_file(tokenizer, kept)
            copied = True
        # into checkpoints/.tmp_step_00000000, renamed step_00000000 when whole (checkpoint.save_full)
        path = save_full(out_dir, cfg, state, kept, step=0, tokens=0)
    except BaseException as e:  # a full disk, Ctrl-C: what the import wrote is removed (the lock and the
        _undo_import(out_dir, kept if copied else None)   # out-dir it made go with lock.release)
        cause = files.os_error_in(e, os.path.join(out_dir, "checkpoints", ".tmp_step_00000000")) \
            if isinstance(e, Exception) else None
        if cause is None:
            raise
        raise UserError(f"{files.os_error_message(cause)} (nothing of the import into {out_dir!r} was "
                        f"kept)") from None
    finally:
        lock.release()
    experts = f", {cfg.moe_experts} experts, top-{cfg.moe_top_k}" if cfg.moe_experts else ""
    print(f"imported {hf_dir} ({cfg.n_layers} layers, d_model {cfg.d_model}{experts}, vocab {cfg.vocab_size} "
          f"padded to {cfg.padded_vocab}) -> {path}")
    return path


def _undo_import(out_dir: str, tokenizer_copy: str | None) -> None:
    """Remove what a failed import wrote: its checkpoint (whole or not) and the tokenizer's copy."""
    from nanohlat.run.checkpoint import ckpt_root
    root = ckpt_root(out_dir)
    for name in (".tmp_step_00000000", "step_00000000"):
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    for path in (os.path.join(root, "latest"), os.path.join(root, "latest.partial"), tokenizer_copy):
        if path and os.path.lexists(path):
            with contextlib.suppress(OSError):
                os.remove(path)
    with contextlib.suppress(OSError):
        os.rmdir(root)      # if empty


@cli.command
def main(argv=None) -> int:
    p = flags.Parser(prog="python -m nanohlat.hf", description="Convert to/from Hugging Face Llama (Mixtral: a mixture of experts).")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="nanohlat run or checkpoint -> Hugging Face directory")
    e.add_argument("checkpoint", metavar="RUN_OR_CKPT")
    e.add_argument("hf_dir", metavar="HF_DIR")
    e.add_argument("--overwrite", action="store_true", help="write into a non-empty HF_DIR, replacing its files")
    i = sub.add_parser("import", help="Hugging Face Llama or Mixtral directory -> nanohlat checkpoint")
    i.add_argument("hf_dir", metavar="HF_DIR")
    i.add_argument("out_dir", metavar="OUT_DIR")
    i.add_argument("--tokenizer", default="", help="SentencePiece model (default HF_DIR/tokenizer.model)")
    i.add_argument("--vocab-multiple", type=int, default=None,
                   help="pad the vocabulary to a multiple of this (default: 128 if it divides, else no padding)")
    i.add_argument("--overwrite", action="store_true", help="replace the run (checkpoints, metrics) in OUT_DIR")
    args = p.parse_args(argv)
    if args.command == "export":
        export(args.checkpoint, args.hf_dir, args.overwrite)
    else:
        import_(args.hf_dir, args.out_dir, args.tokenizer, args.vocab_multiple, args.overwrite)
    return 0


if __name__ == "__main__":
    sys.exit(main())
