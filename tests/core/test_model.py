"""The decoder itself: causality, the KV cache, layout-independent initialisation."""

from __future__ import annotations

import dataclasses

import torch

from nanohlat.recipe import PRESETS
from nanohlat.model import Transformer, full_init, init_weights
from nanohlat.mesh import Group
from nanohlat.serving import generate as gen
from nanohlat.shard_spec import shard

CFG = PRESETS["tiny"][0]


def _model(seed=0, **kw):
    m = Transformer(CFG, **kw)
    init_weights(m, seed)
    return m


def test_causal_masking_later_tokens_never_change_earlier_logits():
    m = _model()
    x = torch.randint(0, CFG.vocab_size, (2, 24))
    base = m(x)
    for t in (0, 7, 23):
        x2 = x.clone()
        x2[:, t] = (x2[:, t] + 1) % CFG.vocab_size
        out = m(x2)
        assert torch.equal(out[:, :t], base[:, :t])          # exactly: nothing flows backwards
        assert not torch.allclose(out[:, t], base[:, t])     # and the changed position does matter


def test_kv_cache_generation_equals_full_forward_generation():
    m = _model().eval()
    prompt = torch.randint(0, CFG.vocab_size, (2, 5))
    cached = torch.tensor(gen.generate_lists(m, prompt.tolist(), 12))        # greedy, through the KV cache
    seq = prompt
    with torch.no_grad():
        for _ in range(12):
            logits = m(seq)[:, -1].float()
            logits[:, CFG.vocab_size:] = float("-inf")
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, seq[:, 5:])


def test_kv_cache_logits_match_full_forward():
    m = _model().eval()
    x = torch.randint(0, CFG.vocab_size, (1, 16))
    full = m(x)
    cache = gen.new_cache(m, 1, 16)
    with torch.no_grad():
        first = gen.cached_forward(m, cache, x[:, :9], torch.arange(0, 9).view(1, -1))
        rest = gen.cached_forward(m, cache, x[:, 9:], torch.arange(9, 16).view(1, -1))   # several new tokens at once
    torch.testing.assert_close(torch.cat([first, rest], 1), full, rtol=1e-5, atol=1e-5)


def test_initialisation_is_identical_across_builds():
    a, b = _model(seed=3), _model(seed=3)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    c = _model(seed=4)
    assert not torch.equal(a.layers["0"].attn.wq.weight, c.layers["0"].attn.wq.weight)


def test_initialisation_is_independent_of_creation_order_and_layout():
    """A parameter's value depends on (seed, name) only: the same in a
    pipeline stage built alone, in a tp shard, or initialised in reverse order."""
    full = dict(_model(seed=5).named_parameters())
    stage1 = _model(seed=5, layers=range(2, 4), first=False, last=True)
    for n, p in stage1.named_parameters():
        assert torch.equal(p, full[n]), n
    for n, p in reversed(list(full.items())):
        assert torch.equal(full_init(n, p.shard.full_shape, CFG, 5), p.detach()), n
    for tp in (2, 4):
        for r in range(tp):
            g = Group("tp", list(range(tp)), r)   # no process group: only shapes and slicing
            m = Transformer(CFG, group=g)
            init_weights(m, 5)
            for n, p in m.named_parameters():
                assert torch.equal(p, shard(full[n].detach(), p.shard.dim, r, tp)), n


def test_kv_head_replicas_get_the_kv_head_of_their_query_heads():
    """tp 8 > 4 kv heads: ranks 2k and 2k+1 hold kv head k (their query heads
    2r, 2r+1 use kv head r // 2), initialised as in one process."""
    full = dict(_model(seed=5).named_parameters())
    D = CFG.head_dim
    for r in range(8):
        g, kv = Group("tp", list(range(8)), r), Group("kv", [r - r % 2, r - r % 2 + 1], r % 2)
        m = Transformer(CFG, group=g, kv_group=kv)
        init_weights(m, 5)
        attn = m.layers["1"].attn
        assert (attn.n_heads, attn.n_kv_heads) == (1, 1)
        for w in ("wk", "wv"):
            p = getattr(attn, w).weight
            assert (p.shard.parts, p.shard.part) == (4, r // 2)
            assert torch.equal(p, full[f"layers.1.attn.{w}.weight"][r // 2 * D:(r // 2 + 1) * D]), (w, r)
        assert torch.equal(attn.wq.weight, full["layers.1.attn.wq.weight"][r * D:(r + 1) * D])


def test_padded_vocabulary_rows_start_at_zero_and_never_win():
    cfg = dataclasses.replace(CFG, vocab_size=500)           # padded to 512
    m = Transformer(cfg)
    init_weights(m, 0)
    assert cfg.padded_vocab == 512
    assert torch.count_nonzero(m.embed.weight[500:]) == 0
    assert torch.count_nonzero(m.head.weight[500:]) == 0
    with torch.no_grad():
        m.head.weight[500:] = 10.0                             # even if padded logits were huge...
    x = torch.randint(0, 500, (1, 8))
    [out] = gen.generate_lists(m, x.tolist(), 20, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert all(int(t) < 500 for t in out)                      # ...they are never sampled
    loss = m(x[:, :-1], x[:, 1:])
    assert torch.isfinite(loss).all()


def test_parameter_count_matches_config_formula():
    assert sum(p.numel() for p in _model().parameters()) == CFG.num_params()


def test_micro_batches_reach_the_model_as_their_own_tensors():
    """data_parallel.split_batch hands the runner one tensor per micro-batch (sent to the
    device on its own, not a view into one batch tensor), and the runner passes
    exactly those tensors to the model: no `tokens[i]` of a device tensor, which
    XLA would bake into the graph as a constant, one graph per i."""
    from nanohlat import data_parallel, device, pipeline
    from nanohlat.recipe import TrainConfig
    from nanohlat.mesh import Mesh
    t = dataclasses.replace(TrainConfig(), batch_size=6, seq_len=16, microbatches=3)
    mesh = Mesh(1, 1, 1).build_groups(None)
    dev = device.get_device("cpu")
    batch = torch.randint(0, CFG.vocab_size, (6, 17))
    tokens, targets = data_parallel.split_batch(batch, mesh, t, dev)
    assert isinstance(tokens, list) and isinstance(targets, list) and len(tokens) == len(targets) == 3
    for i, (x, y) in enumerate(zip(tokens, targets)):
        assert x._base is None and y._base is None and x.is_contiguous()     # its own storage
        assert torch.equal(x, batch[2 * i:2 * i + 2, :-1]) and torch.equal(y, batch[2 * i:2 * i + 2, 1:])
    model = _model()
    seen = []
    original = model.forward
    model.forward = lambda x, targets=None, **kw: (seen.append((x, targets)), original(x, targets, **kw))[1]
    runner = pipeline.PipelineRunner(model, mesh, t, (2, 16, CFG.d_model), torch.float32, dev)
    runner.run(tokens, targets, 1.0)
    assert [(id(x), id(y)) for x, y in seen] == [(id(x), id(y)) for x, y in zip(tokens, targets)]
