"""Serving, part 1: prefill and decode with a KV cache, batched and tensor-parallel.

Generating n tokens after a prompt of P tokens is two different workloads:

    prefill   the P prompt tokens go through the model in one forward pass: one
              big matmul per weight matrix, compute-bound like training. It
              fills the KV cache and gives the first new token's logits.
    decode    then one token per row per step: every weight matrix is read from
              memory to be multiplied by only B vectors, and every row's cached
              keys and values are read once. Memory-bandwidth-bound: a step
              costs about (weight bytes + KV-cache bytes) / bandwidth, nearly
              the same for B = 1 as for B = 8 (`bench.py --generate`).

The KV cache (`new_cache`): per layer, keys and values of every earlier token,
(rows, kv heads, max length, head dim) each. Every forward pass goes through
`cached_forward`: the model gets each token's position (its rotary angles,
model.py:Transformer.forward's `positions`) and a `CachePass`, which its
attention layers call: a token at position p of row b is stored in column p
of row b and attends to columns 0..p of its row. So every row keeps its own
positions and rows of different lengths share one batch:

  * prompts are right-padded for the batched prefill; the padding sits at
    positions after its row's prompt, so no real token attends to it, and the
    row's own new tokens overwrite those columns later;
  * in decode, row b feeds its newest token at its own position.

So batched greedy decoding gives every row exactly the tokens it gets alone
(tests/serving/test_serving.py), and the serving scheduler (server.py) can put a new
request into any free row of a running batch.

Tensor parallelism uses the training layers unchanged: a tp rank holds
n_heads/tp query heads and n_kv_heads/tp kv heads, so its cache holds only
its kv heads (sharded like wk and wv), and attention needs no communication;
wo and down end in an all-reduce, as in training. The head leaves each rank
1/tp of the vocabulary's logits: `full_logits` gathers them, every rank picks
the same next token from the same numbers, and all feed it back.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from nanohlat.run import checkpoint, runconfig
from nanohlat.run.build import decoder
from nanohlat import comm
from nanohlat import shard_spec
from nanohlat.config import UserError
from nanohlat.recipe import ModelConfig, TrainConfig, check_layout, model_from_dict
from nanohlat.mesh import Group
from nanohlat.model import Transformer


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Refuse a tensor-parallel degree the model cannot be split by (UserError),
    with the same rules and messages as training."""
    check_layout(cfg, TrainConfig(tp=tp, batch_size=1), tp)


@torch.no_grad()
def load_model(path: str, dev, mesh=None, copies: int = 1) -> tuple[Transformer, dict]:
    """(this tp rank's slice of the model on `dev`, in eval mode; the manifest).

    Any checkpoint, saved with any (tp, pp, dp, zero1) layout: each full tensor
    is rebuilt from the shards and cut to this rank's slice, as a resumed
    training run does (checkpoint.load). `mesh` must be built with the
    model's kv replicas (mesh.kv_replicas) when tp exceeds its kv heads.
    Every command that uses a model loads it here (sample.py, speculative
    decoding, eval.py, the harness, the HF export; the tests too: there is no
    other inference loader), so each refuses what it
    cannot use in one line: a config that is damaged or does not fit this
    machine (runconfig.check; `copies`: of the weights the caller will hold),
    and non-finite weights."""
    group = mesh.tp_group if mesh is not None else Group("tp", [0], 0)
    path = checkpoint.resolve(path)
    # the cheap checks first (the manifest, its config, the size, the tp degree), then the
    # expensive one: ShardSet reads every byte of every shard for its sha256
    manifest = checkpoint.read_manifest(path)
    runconfig.check(manifest, path, dev.kind, copies, group.size)   # its fields, and that it fits
    cfg = model_from_dict(manifest["config"]["model"])
    check_tp(cfg, group.size)
    shards = checkpoint.ShardSet(path, mesh, dev, manifest)
    model = decoder(cfg, group, kv_group=mesh.group("kv") if mesh is not None else None)   # (a mixture's experts too)
    for name, p in model.named_parameters():
        full = shards.tensor(name, p.shard.full_shape)
        if not bool(torch.isfinite(full).all()):   # every rank sees the full tensor: all refuse together
            raise UserError(f"checkpoint {shards.path} has non-finite weights (NaN or inf) in {name}: it cannot "
                            f"be sampled, evaluated or exported; use an earlier checkpoint (a step_* folder)")
        p.copy_(shard_spec.local_part(full, p))
    checkpoint.load_buffers(shards, model)   # (a mixture's expert biases: it routes as it trained)
    return model.to(dev.torch_device).eval(), shards.manifest


def new_cache(model: Transformer, rows: int, length: int) -> dict:
    """{layer: (keys, values)}, each (rows, local kv heads, length, head dim),
    zeros, in the model's dtype on its device."""
    attn = next(iter(model.layers.values())).attn
    shape = (rows, attn.n_kv_heads, length, attn.head_dim)
    w = next(model.parameters())
    return {i: (w.new_zeros(shape), w.new_zeros(shape)) for i in model.layer_ids}


class CachePass:
    """The KV cache as one forward pass uses it: the pass's tokens sit at
    `positions` (B, T) of rows 0..B-1 of `cache` ({layer: (keys, values)}).
    model.py's Transformer.forward hands `layer(i)` to layer i's attention."""

    def __init__(self, cache: dict, positions: torch.Tensor):
        self.cache, self.positions = cache, positions
        self.columns = int(positions.max()) + 1     # the cache columns anyone in this pass attends to

    def layer(self, i: int):
        return functools.partial(self.attend, i)

    def attend(self, i: int, k: torch.Tensor, v: torch.Tensor):
        """Layer i's new keys and values k, v (B, K, T, D) -> (keys, values,
        mask) for its attention: each token's k and v are written into cache
        column p of its row (p its position), and the tokens attend to columns
        0..S-1 of their rows, (B, K, S, D) each, S = self.columns, through a
        mask (B, 1, T, S) that lets the token at position p see columns 0..p:
        its row's earlier tokens and itself, never a later one (nor a row's
        right padding, which sits after its prompt)."""
        # exercise 1c: begin
        cache_k, cache_v = self.cache[i]
        rows = torch.arange(k.shape[0], device=k.device).unsqueeze(1)             # (B, 1)
        cache_k[rows, :, self.positions] = k.transpose(1, 2)                      # (B, T, K, D) slots
        cache_v[rows, :, self.positions] = v.transpose(1, 2)
        S = self.columns
        mask = torch.arange(S, device=self.positions.device) <= self.positions.unsqueeze(-1)   # (B, T, S)
        return cache_k[:, :, :S], cache_v[:, :, :S], mask.unsqueeze(1)
        # exercise 1c: end


def cached_forward(model: Transformer, cache: dict, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The model on `tokens` (B, T) at `positions` (B, T) of cache rows 0..B-1,
    storing their keys and values: this rank's logits (B, T, V/tp). The one
    way serving runs the model (prefill, decode, the schedulers, speculative
    decoding)."""
    return model(tokens, positions=positions, cache=CachePass(cache, positions))


def cache_rows(cache: dict, start: int, stop: int) -> dict:
    """Rows [start, stop) of a cache, as views: writes go into the big cache."""
    return {i: (k[start:stop], v[start:stop]) for i, (k, v) in cache.items()}


def cache_bytes(cache: dict) -> int:
    return sum(k.numel() * k.element_size() * 2 for k, _ in cache.values())


def full_logits(logits: torch.Tensor, model: Transformer) -> torch.Tensor:
    """This rank's (B, V/tp) slice of the logits -> all real-vocabulary logits
    (B, vocab_size) in fp32, the same on every tp rank."""
    logits = comm.all_gather(logits.float(), model.group, dim=-1)
    return logits[..., :model.cfg.vocab_size]


def probabilities(logits: torch.Tensor, temperature: float, top_k: int = 0) -> torch.Tensor:
    """softmax(logits / temperature) restricted to the top_k largest (0 = all).
    The row's largest logit is subtracted first (softmax does not change): the
    scaled logits are then <= 0, so a tiny temperature cannot overflow them."""
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return F.softmax(logits, dim=-1)


def fit_prompt(ids: list[int], limit: int, max_new_tokens: int, note=None) -> list[int]:
    """One policy for every prompt (sample.py, speculative decoding): a prompt that
    does not fit the model's context of `limit` tokens keeps its first token
    (BOS) and its last limit // 2, so there is room to generate; `note` (if
    given) is called with one line when the prompt is cut, and when the sample
    will stop before `max_new_tokens` because the context is full."""
    if len(ids) >= limit:
        if note:
            note(f"note: a prompt of {len(ids)} tokens does not fit the model's context of {limit}: its first "
                 f"token and its last {limit // 2} are kept")
        ids = ids[:1] + ids[-(limit // 2):]
    if len(ids) + max_new_tokens > limit and note:
        note(f"note: the model's context is {limit} tokens and a prompt uses {len(ids)}: its sample stops "
             f"after {limit - len(ids)} new tokens, not --max-new-tokens {max_new_tokens}")
    return ids


def pick(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, generator=None) -> torch.Tensor:
    """The next token of each row, (B,): the argmax when temperature <= 0, else a
    draw from `probabilities`. Draws happen on the CPU with `generator`, so a
    seed gives the same tokens on every device and every tp rank."""
    if not bool(torch.isfinite(logits).all()):   # (the weights were checked at load: an overflow)
        raise UserError("the model's logits are not finite (NaN or inf): its weights or activations "
                        "overflowed; use an earlier checkpoint")
    if temperature <= 0:
        return logits.argmax(-1)
    probs = probabilities(logits, temperature, top_k).cpu()
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)


@torch.no_grad()
def prefill(model: Transformer, cache: dict, prompts: list[list[int]]) -> torch.Tensor:
    """Run the prompts (lists of token ids, any lengths) through the model in
    one batched pass, writing cache rows 0..len(prompts)-1 (pass `cache_rows`
    to fill other rows). Returns each prompt's last-token logits (B, vocab)."""
    device = model.cos.device
    T = max(len(p) for p in prompts)
    tokens = torch.tensor([p + [0] * (T - len(p)) for p in prompts], device=device)   # right-padded
    positions = torch.arange(T, device=device).expand(len(prompts), T)
    logits = cached_forward(model, cache, tokens, positions)                         # (B, T, V/tp)
    last = torch.tensor([len(p) - 1 for p in prompts], device=device)
    return full_logits(logits[torch.arange(len(prompts), device=device), last], model)


@torch.no_grad()
def decode_step(model: Transformer, cache: dict, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One token per row: tokens and their positions (B,) -> next logits (B, vocab)."""
    logits = cached_forward(model, cache, tokens.view(-1, 1), positions.view(-1, 1))
    return full_logits(logits[:, -1], model)


@torch.no_grad()
def generate(model: Transformer, prompts: list[list[int]], max_new_tokens, temperature: float = 0.0,
             top_k: int = 0, generator=None, eos_id: int | None = None, sync=None):
    """Decode all prompts together. Yields, once per step, a list with one new
    token per row, or None for a row that has finished (it produced eos_id, its
    max_new_tokens (an int, or one per row), or reached the model's max_seq_len).
    `sync`, when given, is called after every step (XLA: cut the graph there
    and keep the cache)."""
    B, lengths = len(prompts), [len(p) for p in prompts]
    wanted = max_new_tokens if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * B
    budget = [min(w, model.cfg.max_seq_len - n) for w, n in zip(wanted, lengths)]
    length = max(n + b for n, b in zip(lengths, budget))
    cache = new_cache(model, B, length)
    logits = prefill(model, cache, prompts)
    positions = torch.tensor(lengths, device=logits.device)
    made, done = [0] * B, [b <= 0 for b in budget]
    while not all(done):
        nxt = pick(logits, temperature, top_k, generator)
        out = []
        for b, t in enumerate(nxt.tolist()):
            if done[b]:
                out.append(None)
                continue
            out.append(t)
            made[b] += 1
            done[b] = t == eos_id or made[b] >= budget[b]
        yield out
        if all(done):
            return
        # finished rows keep computing (a batch has one shape) at a harmless, clamped position
        logits = decode_step(model, cache, nxt, positions)
        positions = (positions + 1).clamp(max=length - 1)
        if sync is not None:
            sync()


def generate_lists(model: Transformer, prompts: list[list[int]], max_new_tokens, **kw) -> list[list[int]]:
    """`generate`, collected: the new tokens of each prompt (eos included if produced)."""
    out: list[list[int]] = [[] for _ in prompts]
    for step in generate(model, prompts, max_new_tokens, **kw):
        for row, t in zip(out, step):
            if t is not None:
                row.append(t)
    return out
