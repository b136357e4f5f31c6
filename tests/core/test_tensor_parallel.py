"""Each tensor-parallel layer equals the unsharded layer: outputs, input
gradients and weight gradients, for tp = 2 and 4, with and without sequence
parallel, and the vocab-parallel cross-entropy including padded vocabulary;
and attention with more tp ranks than kv heads (replicated kv heads); and
the ShardSpec every parameter carries, kept by Device.place.

Every rank builds the same full tensors from a shared seed, runs the sharded
layer on its slice, and checks its slice of every result against the plain
computation. The sharded matmuls add the same products in a different
grouping, so results differ by fp32 round-off, which is relative to the size
of the terms summed, not of the result: an element that cancels to 0.2 among
terms of 40 (attention's weight gradients reach 47 here) carries 40's
round-off. So `close` allows 1e-5 relative plus 1e-6 of the reference
tensor's largest value (at least 1e-5). Measured: 1.4e-5 on a wv gradient
element of 0.23 whose tensor peaks at 41 (an AVX-512 CPU). A wrong shard or a
missing reduction is off by the values themselves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dist_utils import fixed_threads, spawn_workers



def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 round-off of sums over terms as large as the tensor's largest value (module docstring)."""
    scale = expected.detach().abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=max(1e-5, 1e-6 * scale))


def _check_layers(rank, tp):
    from nanohlat import tensor_parallel as tpl
    from nanohlat.mesh import Group
    import torch.distributed as dist
    group = Group("tp", list(range(tp)), rank, dist.group.WORLD)
    g = torch.Generator().manual_seed(0)
    B, T, Cin, Cout = 2, 8, 16, 24
    x = torch.randn(B, T, Cin, generator=g)
    W = torch.randn(Cout, Cin, generator=g)
    G = torch.randn(B, T, Cout, generator=g)           # upstream gradient of the output
    chunk = lambda t, d: t.chunk(tp, dim=d)[rank]

    # the reference: plain linear, autograd
    xr, Wr = x.clone().requires_grad_(), W.clone().requires_grad_()
    (F.linear(xr, Wr) * G).sum().backward()
    y_full = F.linear(x, W)

    for sp in (False, True):
        # column-parallel: enter the tp region, then this rank's output features
        col = tpl.ColumnParallelLinear(Cin, Cout, group)
        col.weight.data.copy_(chunk(W, 0))
        xi = (chunk(x, 1) if sp else x).clone().requires_grad_()
        y = col(tpl.enter(xi, group, sp))
        close(y, chunk(y_full, 2))
        (y * chunk(G, 2)).sum().backward()
        close(xi.grad, chunk(xr.grad, 1) if sp else xr.grad)
        close(col.weight.grad, chunk(Wr.grad, 0))

        # row-parallel: this rank's input features, partial sums added by `leave`
        row = tpl.RowParallelLinear(Cin, Cout, group, sp)
        row.weight.data.copy_(chunk(W, 1))
        xi = chunk(x, 2).clone().requires_grad_()
        y = row(xi)
        close(y, chunk(y_full, 1) if sp else y_full)
        (y * (chunk(G, 1) if sp else G)).sum().backward()
        close(xi.grad, chunk(xr.grad, 2))
        close(row.weight.grad, chunk(Wr.grad, 1))

        # vocab-parallel embedding
        V = 32
        E = torch.randn(V, Cin, generator=g)
        tokens = torch.randint(0, V, (B, T), generator=g)
        Er = E.clone().requires_grad_()
        Ge = torch.randn(B, T, Cin, generator=g)
        (F.embedding(tokens, Er) * Ge).sum().backward()
        emb = tpl.VocabParallelEmbedding(V, Cin, group, sp)
        emb.weight.data.copy_(chunk(E, 0))
        out = emb(tokens)
        close(out, chunk(F.embedding(tokens, E), 1) if sp else F.embedding(tokens, E))
        (out * (chunk(Ge, 1) if sp else Ge)).sum().backward()
        close(emb.weight.grad, chunk(Er.grad, 0))

    # vocab-parallel cross-entropy; vocab 29 padded to 32, padded logits large on purpose
    V, vocab = 32, 29
    logits = torch.randn(B, T, V, generator=g) * 3
    logits[..., vocab:] = 50.0
    targets = torch.randint(0, vocab, (B, T), generator=g)
    lr = logits.clone().requires_grad_()
    ref = F.cross_entropy(lr[..., :vocab].reshape(-1, vocab), targets.reshape(-1), reduction="none").view(B, T)
    ref.sum().backward()
    li = chunk(logits, 2).clone().requires_grad_()
    loss = tpl.vocab_parallel_cross_entropy(li, targets, group, vocab)
    close(loss, ref)
    loss.sum().backward()
    close(li.grad, chunk(lr.grad, 2))      # padded entries: zero grad


def _check_kv_replicas(rank, tp):
    """Attention at tp 4 with 2 kv heads: ranks [0 1] hold kv head 0, [2 3] kv
    head 1. Output, input gradient and every weight gradient equal one
    process's, wk's and wv's once summed over the kv group (as
    optim.FlatAdamW.reduce_gradients sums them, once per step); after that sum
    the two replicas of a kv head hold bitwise equal gradients."""
    import dataclasses
    import torch.distributed as dist
    from nanohlat import comm
    from nanohlat.recipe import PRESETS
    from nanohlat.mesh import Group
    from nanohlat.model import Attention, rotary_tables
    cfg = dataclasses.replace(PRESETS["tiny"][0], n_kv_heads=2)
    r = tp // cfg.n_kv_heads
    kv_pgs = [dist.new_group(list(range(i, i + r))) for i in range(0, tp, r)]   # every rank creates every group
    group = Group("tp", list(range(tp)), rank, dist.group.WORLD)
    kv = Group("kv", list(range(rank - rank % r, rank - rank % r + r)), rank % r, kv_pgs[rank // r])
    g = torch.Generator().manual_seed(1)
    B, T, C = 2, 8, cfg.d_model
    x, G = torch.randn(B, T, C, generator=g), torch.randn(B, T, C, generator=g)
    cos, sin = rotary_tables(cfg.head_dim, T, cfg.rope_theta)
    ref = Attention(cfg, Group("tp", [0], 0), False)
    for lin in (ref.wq, ref.wk, ref.wv, ref.wo):
        lin.weight.data.copy_(torch.randn(lin.weight.shape, generator=g) * 0.2)
    xr = x.clone().requires_grad_()
    (ref(xr, cos, sin) * G).sum().backward()
    y_full = ref(x, cos, sin).detach()
    chunk = lambda t, d: t.chunk(tp, dim=d)[rank]
    for sp in (False, True):
        attn = Attention(cfg, group, sp, kv)
        for name in ("wq", "wk", "wv", "wo"):
            p = getattr(attn, name).weight
            p.data.copy_(getattr(ref, name).weight.detach().chunk(p.shard.parts, p.shard.dim)[p.shard.part])
        xi = (chunk(x, 1) if sp else x).clone().requires_grad_()
        y = attn(xi, cos, sin)
        close(y, chunk(y_full, 1) if sp else y_full)
        (y * (chunk(G, 1) if sp else G)).sum().backward()
        close(xi.grad, chunk(xr.grad, 1) if sp else xr.grad)
        for name in ("wk", "wv"):   # each replica's gradient covers its own query heads: add them up
            p = getattr(attn, name).weight
            p.grad = comm.all_reduce(p.grad, kv)
        for name in ("wq", "wk", "wv", "wo"):
            p = getattr(attn, name).weight
            close(p.grad, getattr(ref, name).weight.grad.chunk(p.shard.parts, p.shard.dim)[p.shard.part])
        for name in ("wk", "wv"):   # the replicas' summed gradients: the same bits on both ranks of a kv group
            grad = getattr(attn, name).weight.grad
            both = comm.all_gather(grad.unsqueeze(0), kv, dim=0)
            assert torch.equal(both[0], both[1]), name


def _worker(rank, tp):
    import torch.distributed as dist
    torch.set_num_threads(fixed_threads())
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    try:
        _check_layers(rank, tp)
        if tp == 4:
            _check_kv_replicas(rank, tp)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp", [2, 4])
def test_parallel_layers_equal_unsharded(tp, tmp_path):
    spawn_workers(_worker, tp, (), str(tmp_path))


def test_single_rank_layers_are_the_plain_layers():
    from nanohlat import tensor_parallel as tpl
    from nanohlat.mesh import Group
    g = Group("tp", [0], 0)
    x = torch.randn(2, 4, 8)
    row = tpl.RowParallelLinear(8, 6, g, sequence_parallel=True)
    torch.nn.init.normal_(row.weight)
    assert torch.equal(row(x), F.linear(x, row.weight))
    assert tpl.enter(x, g, True) is x


def test_single_rank_cross_entropy_ignores_padded_vocab():
    """tp=1 takes F.cross_entropy's fused path: padded ids still get no probability, no gradient."""
    from nanohlat import tensor_parallel as tpl
    from nanohlat.mesh import Group
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 32, generator=g) * 3
    logits[..., 29:] = 50.0                                   # padded entries, large on purpose
    targets = torch.randint(0, 29, (2, 5), generator=g)
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = tpl.vocab_parallel_cross_entropy(a, targets, Group("tp", [0], 0), 29)
    ref = F.cross_entropy(b[..., :29].reshape(-1, 29), targets.reshape(-1), reduction="none").view(2, 5)
    torch.testing.assert_close(loss, ref)
    loss.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(a.grad, b.grad)
    assert a.grad[..., 29:].abs().max() == 0


@pytest.mark.parametrize("tp, rank, sp", [(1, 0, False), (4, 3, True), (8, 5, True)])
def test_every_parameter_carries_one_shard_spec(tp, rank, sp):
    """The sharding contract: each parameter carries one ShardSpec as `p.shard`
    and nothing else; its local shape is the full shape cut into `parts` along
    `dim`; only replicated weights of a sequence-parallel model (the norms) are
    marked sequence_parallel; at tp 8 > 4 kv heads wk and wv have 4 parts,
    each held by 2 ranks."""
    from nanohlat import shard_spec
    from nanohlat.recipe import ModelConfig
    from nanohlat.mesh import Group
    from nanohlat.model import Transformer
    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=128, max_seq_len=16)
    r = max(tp // cfg.n_kv_heads, 1)
    kv = Group("kv", list(range(rank - rank % r, rank - rank % r + r)), rank % r) if r > 1 else None
    model = Transformer(cfg, Group("tp", list(range(tp)), rank), sp, kv_group=kv)
    for name, p in model.named_parameters():
        s = p.shard
        assert isinstance(s, shard_spec.ShardSpec) and set(vars(p)) == {"shard"}, name
        local = list(s.full_shape)
        if s.dim is not None:
            local[s.dim] //= s.parts
        assert list(p.shape) == local, name
        want = (1, 0) if s.dim is None else \
            (tp // r, rank // r) if name.endswith(("wk.weight", "wv.weight")) else (tp, rank)
        assert (s.parts, s.part) == want, name
        assert s.sequence_parallel == (sp and tp > 1 and s.dim is None), name


def test_place_reattaches_the_shard_spec_when_a_move_makes_new_parameters(monkeypatch):
    """Device.place keeps `p.shard` across a move that makes new Parameter
    objects, as a move to XLA does (simulated here on the CPU)."""
    from nanohlat.recipe import ModelConfig
    from nanohlat.device import Device
    from nanohlat.model import Transformer
    model = Transformer(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64,
                                    max_seq_len=16))
    want = {name: p.shard for name, p in model.named_parameters()}
    real_to = torch.nn.Module.to

    def to_new_parameters(self, *args, **kwargs):
        real_to(self, *args, **kwargs)
        for m in self.modules():
            for name, p in list(m._parameters.items()):
                m._parameters[name] = torch.nn.Parameter(p.detach().clone())   # no attributes
        return self
    monkeypatch.setattr(torch.nn.Module, "to", to_new_parameters)
    Device("cpu", torch.device("cpu"), "gloo", "cpu").place(model, torch.bfloat16)
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and p.shard is want[name], name


def _check_sp_regather(rank, tp):
    """A sequence-parallel model (tiny, 2 layers) with --sp-regather (keep the
    T/tp shard, gather again in backward) and without (keep the gathered
    sequence): the same losses and the same gradients, bit for bit, in fp32 and
    bf16, with and without selective / full activation checkpointing."""
    import dataclasses
    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint
    from nanohlat.recipe import PRESETS
    from nanohlat.mesh import Group
    from nanohlat.model import Transformer, init_weights
    cfg = dataclasses.replace(PRESETS["tiny"][0], n_layers=2)
    group = Group("tp", list(range(tp)), rank, dist.group.WORLD)
    g = torch.Generator().manual_seed(3)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (2, 16), generator=g) for _ in range(2))
    ckpt = lambda fn, *a: checkpoint(fn, *a, use_reentrant=False)
    for dtype in (torch.float32, torch.bfloat16):
        for mode in ("none", "selective", "full"):
            results = []
            for regather in (True, False):
                model = Transformer(cfg, group, sequence_parallel=True, sp_regather=regather)
                init_weights(model, 0)
                model.to(dtype).set_activation_checkpointing(mode, ckpt)
                loss = model(tokens, targets).float().mean()
                loss.backward()
                results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
            (a, ga), (b, gb) = results
            assert torch.equal(a, b), (dtype, mode, a, b)
            for name in ga:
                assert torch.equal(ga[name], gb[name]), (dtype, mode, name)


def _gloo_worker(rank, tp, check):
    """Run check(rank, tp) in a gloo group of tp processes (spawn_workers' fn)."""
    import torch.distributed as dist
    torch.set_num_threads(fixed_threads())
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    try:
        check(rank, tp)
    finally:
        dist.destroy_process_group()


def test_sp_regather_is_bitwise_the_kept_gather(tmp_path):
    spawn_workers(_gloo_worker, 2, (_check_sp_regather,), str(tmp_path))


def _check_split_backward(rank, tp):
    """zb-h1's split backward (B: input gradients, the linears' dW stashed; W:
    each dW = g^T x handed to autograd) gives the unsplit backward's losses and
    gradients bit for bit: fp32 and bf16 (the parameter dtype of every bf16
    precision), every activation checkpointing mode, and at tp > 1 without
    sequence parallel and with it, gathering again in backward (regather: then
    in W) or not. The parameters' post-accumulate-grad hooks (optim.py's way
    into the flat buffer) fire once with a gradient per parameter, and the
    bytes B leaves for W are the plan's."""
    import dataclasses
    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint
    from nanohlat.beyond import split_backward
    from nanohlat.recipe import PRESETS
    from nanohlat.mesh import Group
    from nanohlat.recipe import TrainConfig
    from nanohlat.model import Transformer, init_weights
    from nanohlat import plan
    cfg = dataclasses.replace(PRESETS["tiny"][0], n_layers=2)
    group = Group("tp", list(range(tp)), rank, dist.group.WORLD if tp > 1 else None)
    g = torch.Generator().manual_seed(3)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (2, 16), generator=g) for _ in range(2))
    ckpt = lambda fn, *a: checkpoint(fn, *a, use_reentrant=False)
    layouts = [(False, True)] + ([(True, True), (True, False)] if tp > 1 else [])
    for dtype in (torch.float32, torch.bfloat16):
        for mode in ("none", "selective", "full"):
            for sp, regather in layouts:
                results = []
                for split in (False, True):
                    model = Transformer(cfg, group, sequence_parallel=sp, sp_regather=regather)
                    if split:
                        split_backward.apply(model)       # (as run/build.py does for zb-h1)
                    init_weights(model, 0)
                    model.to(dtype).set_activation_checkpointing(mode, ckpt)
                    fired = []
                    for n, p in model.named_parameters():
                        p.register_post_accumulate_grad_hook(lambda p, n=n: fired.append(n) if p.grad is not None else None)
                    with split_backward.SplitBackward(model if split else None) as deferring:
                        loss = model(tokens, targets).float().mean()
                        loss.backward()                           # B (split) or the whole backward
                        stash = deferring.stash
                    assert bool(stash) == split
                    in_b = {n for n, p in model.named_parameters() if p.grad is not None}
                    if split:    # what B left for W is what --plan counts (plan/memory.py:weight_grad_bytes)
                        kept = {t.untyped_storage().data_ptr(): t.nbytes for _, x, _, gs in stash for t in (x, *gs)}
                        tcfg = TrainConfig(batch_size=2, seq_len=16, sequence_parallel=sp, sp_regather=regather,
                                           precision="fp32" if dtype == torch.float32 else "bf16")
                        assert sum(kept.values()) == plan.weight_grad_bytes(cfg, tcfg, tp, 1, 1, 0), (dtype, mode, sp)
                    split_backward.weight_grads(stash)                       # W
                    assert sorted(fired) == sorted(n for n, _ in model.named_parameters())
                    results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}, in_b))
                (a, ga, _), (b, gb, in_b) = results
                what = (dtype, mode, sp, regather)
                assert torch.equal(a, b), what
                for name in ga:
                    assert torch.equal(ga[name], gb[name]), (what, name)
                # only the norm gains and the embedding got their gradients in B
                assert in_b and all(n.endswith("norm.weight") or n == "embed.weight" for n in in_b), (what, in_b)


def test_split_backward_is_bitwise_the_unsplit_one_in_one_process():
    _check_split_backward(0, 1)


def test_split_backward_is_bitwise_the_unsplit_one_with_tp_and_sp(tmp_path):
    spawn_workers(_gloo_worker, 2, (_check_split_backward,), str(tmp_path))
