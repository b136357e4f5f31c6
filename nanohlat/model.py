"""The HLAT / LLaMA-2 decoder, written once for every layout.

    tokens (B, T)
      -> embedding                                  (first pipeline stage only)
      -> n_layers x Block:  x = x + Attention(RMSNorm(x))
                            x = x + SwiGLU-MLP(RMSNorm(x))
      -> RMSNorm -> head -> cross-entropy           (last pipeline stage only)

Pre-norm, RMSNorm (eps 1e-5), rotary position embeddings in Hugging Face's
rotate-half convention (theta 1e4), SwiGLU, no biases, untied input/output
embeddings, optional grouped-query attention (n_kv_heads < n_heads).

One `Transformer` object is one pipeline *stage*: it owns a contiguous range
of layers (all of them when pp=1) and, inside each layer, its tensor-parallel
slice of every matrix (all of it when tp=1, where every parallel layer is
exactly the plain layer and every communication call is a no-op). Parameter
names are global (`layers.7.attn.wq.weight` is layer 7 on whichever stage has
it), which is what makes initialisation and checkpoints layout-independent.

Shape names: B batch, T sequence, C d_model, H local query heads, K local kv
heads, D head dim, F local ffn size, V local (padded) vocabulary, tp tensor
degree. With sequence parallel the residual stream is (B, T/tp, C).
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import shard_spec, tensor_parallel as tpl
from .comm import Group
from .config import ModelConfig


class RMSNorm(nn.Module):
    """x / rms(x) * w, computed in fp32 (a bf16 mean of squares loses too much)."""

    def __init__(self, dim: int, eps: float, sequence_parallel: bool):
        super().__init__()
        self.eps = eps
        self.weight = shard_spec._param((dim,), None, 1, sequence_parallel=sequence_parallel)

    def forward(self, x):
        # exercise 1a: begin
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)
        # exercise 1a: end


def rotary_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (max_seq_len, D): position t rotates pair i by t * theta^(-2i/D).

    Rotate-half convention (Hugging Face Llama): the pairs are (x_i, x_{i+D/2}),
    so the frequencies are repeated [f_0..f_{D/2-1}, f_0..f_{D/2-1}].
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)   # (T, D/2)
    angles = torch.cat([angles, angles], dim=-1)                                      # (T, D)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    """x: (B, heads, T, D); cos/sin: (T, D), or (B, 1, T, D) for per-row positions."""
    # exercise 1b: begin
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)           # "rotate half"
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)
    # exercise 1b: end


def attention_core(q, k, v, causal: bool, mask=None):
    """softmax(q k^T / sqrt(D) + causal mask) v. The part selective activation
    checkpointing recomputes: its (B, H, T, T) intermediates are the largest
    activations of the block, yet cheap to recompute (Korthikanti et al.)."""
    if k.shape[1] != q.shape[1] and (q.is_cuda or q.dtype != torch.float32):   # grouped-query attention:
        rep = q.shape[1] // k.shape[1]   # a kv copy per query head (tutorial chapter 1: where and why)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    # in fp32 on the CPU the kernel reads each kv head for its H/K query heads (XLA's decomposition copies)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          enable_gqa=k.shape[1] != q.shape[1])


def causal_attention(q, k, v):
    """Training's attention core: each token attends to itself and the tokens before it."""
    return attention_core(q, k, v, True)


class Attention(nn.Module):
    """Each tp rank computes n_heads/tp query heads and the kv heads they use:
    n_kv_heads/tp of them, or, with more tp ranks than kv heads, a replica of
    the one kv head its query heads share (the kv group `kv_group` holds the
    tp/n_kv_heads replicas; tensor_parallel.py's docstring)."""

    def __init__(self, cfg: ModelConfig, group: Group, sequence_parallel: bool, kv_group: Group | None = None,
                 regather: bool = True):
        super().__init__()
        tp = group.size
        replicas = kv_group.size if kv_group is not None else 1
        assert replicas == max(tp // cfg.n_kv_heads, 1), \
            f"tp {tp} with {cfg.n_kv_heads} kv heads needs kv groups of {max(tp // cfg.n_kv_heads, 1)} ranks"
        self.group, self.sequence_parallel, self.regather = group, sequence_parallel, regather
        self.n_heads, self.n_kv_heads = cfg.n_heads // tp, cfg.n_kv_heads * replicas // tp   # on this rank
        self.head_dim = cfg.head_dim
        self.wq = tpl.ColumnParallelLinear(cfg.d_model, cfg.n_heads * cfg.head_dim, group)
        self.wk = tpl.ColumnParallelLinear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, group, kv_group)
        self.wv = tpl.ColumnParallelLinear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, group, kv_group)
        self.wo = tpl.RowParallelLinear(cfg.n_heads * cfg.head_dim, cfg.d_model, group, sequence_parallel)
        # (q, k, v) -> y in training: any function computing the same (a seam: docs/design.md 1)
        self.core = causal_attention
        self.checkpoint_core = None   # set to a checkpoint function for selective recompute

    def forward(self, x, cos, sin, cache=None):
        """x: (B, T or T/tp, C); cos/sin: the rotary angles of the T tokens.
        Training (no cache): each token attends to itself and the tokens before
        it in x. Serving passes this layer's `cache` (a function,
        serving/generate.py:CachePass.attend), which stores the new keys and
        values and returns the keys and values the new tokens attend to, with
        the mask of which each may see."""
        # enter the tp region (full sequence T), then wq, wk, wv: (B, T, H*D), (B, T, K*D) x 2
        qkv = (self.wq, self.wk, self.wv)
        q, k, v = tpl.enter_linears(x, self.group, self.sequence_parallel, qkv, self.regather)
        B, T, _ = q.shape
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)      # (B, H, T, D)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)   # (B, K, T, D)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)   # (B, K, T, D)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v, mask = cache(k, v)                        # (B, K, S, D) each, mask (B, 1, T, S)
            y = attention_core(q, k, v, False, mask)
        elif self.checkpoint_core is not None:
            y = self.checkpoint_core(self.core, q, k, v)    # selective: recomputed in the backward
        else:
            y = self.core(q, k, v)                          # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H*D)
        return self.wo(y)                                  # (B, T or T/tp, C) after the reduce


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate/up column-parallel, down row-parallel."""

    def __init__(self, cfg: ModelConfig, group: Group, sequence_parallel: bool, regather: bool = True):
        super().__init__()
        self.group, self.sequence_parallel, self.regather = group, sequence_parallel, regather
        self.gate = tpl.ColumnParallelLinear(cfg.d_model, cfg.ffn_dim, group)
        self.up = tpl.ColumnParallelLinear(cfg.d_model, cfg.ffn_dim, group)
        self.down = tpl.RowParallelLinear(cfg.ffn_dim, cfg.d_model, group, sequence_parallel)

    def forward(self, x):
        gate, up = tpl.enter_linears(x, self.group, self.sequence_parallel, (self.gate, self.up),
                                     self.regather)
        return self.down(F.silu(gate) * up)                              # (B, T(/tp), C)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, group: Group, sequence_parallel: bool, kv_group: Group | None = None,
                 regather: bool = True):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, sequence_parallel)
        self.attn = Attention(cfg, group, sequence_parallel, kv_group, regather)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, sequence_parallel)
        self.mlp = MLP(cfg, group, sequence_parallel, regather)   # or any module of its shape (a seam)

    def forward(self, x, cos, sin, cache=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, cache)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """One pipeline stage of the decoder (the whole model when pp=1). `group`:
    the tp group; `kv_group`: the ranks sharing a kv head when tp > n_kv_heads
    (mesh.group("kv")); `sp_regather`: with sequence parallel, keep only each
    rank's T/tp tokens for the column-parallel matmuls' backward and gather
    them again there (--sp-regather; tensor_parallel.enter_linears).

    Every part is an ordinary attribute, so a layer can be given another one of
    the same interface after construction, before init_weights: a block's `mlp`
    and its linears, its attention's `core`; and two the stage declares unset:
    `token_positions`, where a training sequence's T tokens on this rank sit in
    it, and `step_figures`, what a part reports of each training step (each a
    seam: docs/design.md 1)."""

    def __init__(self, cfg: ModelConfig, group: Group | None = None, sequence_parallel: bool = False,
                 layers: range | list[int] | None = None, first: bool = True, last: bool = True,
                 kv_group: Group | None = None, sp_regather: bool = True):
        super().__init__()
        group = group or Group("tp", [0], 0)
        self.cfg, self.group = cfg, group
        self.sequence_parallel = sequence_parallel and group.size > 1
        self.first, self.last = first, last
        self.layer_ids = list(layers if layers is not None else range(cfg.n_layers))
        sp = self.sequence_parallel
        if first:
            self.embed = tpl.VocabParallelEmbedding(cfg.padded_vocab, cfg.d_model, group, sp)
        self.sp_regather = sp_regather
        self.layers = nn.ModuleDict({str(i): Block(cfg, group, sp, kv_group, sp_regather)
                                     for i in self.layer_ids})
        if last:
            self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, sp)
            self.head = tpl.ColumnParallelLinear(cfg.d_model, cfg.padded_vocab, group)
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.block_checkpoint = None  # full activation checkpointing: recompute whole blocks
        # two seams (docs/design.md 1): T -> the positions (T,) of this rank's T tokens in a training
        # sequence (None: 0..T-1); what a part reports of each training step to log beside the loss
        self.token_positions = None
        self.step_figures = None

    def set_activation_checkpointing(self, mode: str, checkpoint_fn) -> None:
        """none | selective (recompute the attention core, as HLAT did) | full (recompute blocks)."""
        for block in self.layers.values():
            block.attn.checkpoint_core = checkpoint_fn if mode == "selective" else None
        self.block_checkpoint = checkpoint_fn if mode == "full" else None

    def forward(self, x, targets=None, positions=None, cache=None, layers=None):
        """x: tokens (B, T) on the first stage, else the residual stream from the
        previous stage. Returns, on the last stage, per-token losses (B, T) when
        targets are given, else this rank's logits (B, T, V/tp); on other stages
        the residual stream (B, T or T/tp, C) for the next stage.

        positions (B, T): each token's position in its sequence (the rotary
        angles); when not given (training), `rotary`'s, the same in every row.
        cache (serving: serving/generate.py:CachePass, with the same positions):
        where each layer's attention keeps the new keys and values and finds
        the earlier ones; `cache.layer(i)` is layer i's part.

        layers: run only these of this stage's layers (a chunk of a pipeline
        stage that holds several); the embedding runs only before layer 0 and
        the head only after the last layer. None: all of them, embedding and
        head included where held."""
        ids = self.layer_ids if layers is None else list(layers)
        embeds = self.first and ids[0] == 0
        ends = self.last and ids[-1] == self.cfg.n_layers - 1
        T = x.shape[1] * (self.group.size if (self.sequence_parallel and not embeds) else 1)
        if positions is None:
            cos, sin = self.rotary(T)                                               # (T, D)
        else:
            cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)   # (B, 1, T, D)
        if embeds:
            x = self.embed(x)                                  # (B, T or T/tp, C)
        for i in ids:
            block = self.layers[str(i)]
            if cache is not None:
                x = block(x, cos, sin, cache.layer(i))
            elif self.block_checkpoint is not None:
                x = self.block_checkpoint(block, x, cos, sin)
            else:
                x = block(x, cos, sin)
        if not ends:
            return x                                           # to the next stage
        logits, = tpl.enter_linears(self.norm(x), self.group, self.sequence_parallel, (self.head,),
                                    self.sp_regather)                    # (B, T, V/tp)
        if targets is None:
            return logits
        return tpl.vocab_parallel_cross_entropy(logits, targets, self.group, self.cfg.vocab_size)   # (B, T)

    def rotary(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary angles of a training sequence's T tokens on this rank: (T, D) each, at positions
        0..T-1, or where `token_positions` places them."""
        if self.token_positions is None:
            return self.cos[:T], self.sin[:T]
        mine = self.token_positions(T).to(self.cos.device)
        return self.cos[mine], self.sin[mine]


# ---------------------------------------------------------------------------
# Layout-independent initialisation (docs/design.md 5.1)
# ---------------------------------------------------------------------------

def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, global parameter name): the same on every rank
    and every layout, independent of the order parameters are created in."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def full_init(name: str, full_shape, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The full-size initial value of one parameter, on the CPU, in fp32.

    Matrices ~ N(0, 0.02), norm weights 1. Output projections of each block
    (wo, down) are scaled by 1/sqrt(2 n_layers) (GPT-2), since 2 n_layers
    residual branches add up. Padded vocabulary rows start (and, having no
    gradient, stay) at zero.
    """
    if len(full_shape) == 1:
        return torch.ones(full_shape)
    g = torch.Generator().manual_seed(param_seed(seed, name))
    std = 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith(("wo.weight", "down.weight")) else 0.02
    w = torch.randn(full_shape, generator=g) * std
    if name in ("embed.weight", "head.weight"):
        w[cfg.vocab_size:] = 0
    return w


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> None:
    """Fill every parameter with its part of the full-size initial tensor,
    one parameter at a time (a 7B model never exists in full on one rank).
    The replicas of a kv head cut the same part: equal from the start."""
    for name, p in model.named_parameters():
        full = full_init(name, p.shard.full_shape, model.cfg, seed)
        p.copy_(shard_spec.local_part(full, p))
