"""The rank layout of docs/design.md section 4, its table, and the layouts we refuse."""

from __future__ import annotations

import dataclasses

import pytest

from nanohlat.config import UserError
from nanohlat.recipe import PRESETS, TrainConfig, check_layout as validate_layout
from nanohlat.mesh import Mesh, coords, rank_of
from nanohlat.plan.sheets import layout_table

CFG = PRESETS["tiny"][0]


def test_rank_and_coordinates_are_inverse_and_tp_is_fastest():
    for tp, pp, dp in [(1, 1, 1), (2, 2, 2), (4, 2, 3), (8, 1, 4), (2, 4, 1)]:
        seen = set()
        for r in range(tp * pp * dp):
            d, p, t = coords(r, tp, pp, dp)
            assert rank_of(d, p, t, tp, dp) == r
            assert r == (p * dp + d) * tp + t
            seen.add((d, p, t))
        assert len(seen) == tp * pp * dp
    assert [coords(r, 2, 2, 2)[2] for r in range(4)] == [0, 1, 0, 1]      # neighbours share tp groups


def test_layout_table_for_tp2_pp2_dp2():
    table = layout_table(2, 2, 2, n_layers=4)
    rows = [line.split()[:4] for line in table.splitlines()[2:]]
    assert rows == [[str(r), *map(str, coords(r, 2, 2, 2))] for r in range(8)]
    assert "0-1  +embedding" in table and "2-3  +norm,head,loss" in table


def test_kv_groups_are_neighbouring_tp_ranks_sharing_a_kv_head():
    from nanohlat.mesh import kv_replicas
    assert kv_replicas(dataclasses.replace(CFG, n_kv_heads=2), 4) == 2 and kv_replicas(CFG, 4) == 1
    assert kv_replicas(PRESETS["hlat-70b"][0], 32) == 4
    m = Mesh(4, 1, 2, rank=6, kv_replicas=2).build_groups(None)
    assert m._all("kv") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert m.group("kv").ranks == [6, 7] and m.group("kv").rank == 0
    assert Mesh(4, 1, 1)._all("kv") == []                 # no replicas: no kv groups


def test_pair_groups_wrap_around_so_every_rank_is_in_each_partition():
    m = Mesh(1, 4, 1)
    assert m._all("pair_even") == [[0, 1], [2, 3]]
    assert m._all("pair_odd") == [[1, 2], [0, 3]]          # stage 3 <-> 0: the wrap pair (interleaved)
    for r in (0, 3):   # a group's ranks in increasing order, as torch.distributed numbers them
        wrap = Mesh(1, 4, 1, rank=r).build_groups(None).group("wrap")
        assert wrap.ranks == [0, 3] and wrap.rank == (r == 3)
    for r in range(4):
        m = Mesh(1, 4, 1, rank=r).build_groups(None)
        assert ("prev" in m.groups) == (r > 0) and ("next" in m.groups) == (r < 3)
        assert m.group("next").ranks == [r, r + 1] if r < 3 else m.group("next").ranks == [r]
    assert Mesh(2, 2, 1)._all("pair_odd") == []             # pp 2: one boundary, as before
    assert Mesh(1, 3, 1)._all("pair_odd") == [[1, 2]]       # odd pp: no disjoint ring pairs


def test_groups_of_each_kind_partition_the_world():
    m = Mesh(2, 2, 2, rank=5)
    assert m._all("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert m._all("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert m._all("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert m._all("pair_even") == [[0, 4], [1, 5], [2, 6], [3, 7]] and m._all("pair_odd") == []
    m.build_groups(None)                  # no backend: bookkeeping only
    assert m.tp_group.ranks == [4, 5] and m.tp_group.rank == 1
    assert m.group("prev").ranks == [1, 5] and m.group("prev").rank == 1


def _train(**kw):
    return dataclasses.replace(TrainConfig(), **({"batch_size": 8, "seq_len": 32} | kw))


@pytest.mark.parametrize("kw, world, message", [
    (dict(tp=3), 3, "--tp 3 does not divide n_heads 8; choose 1, 2, 4 or 8"),
    (dict(tp=2, pp=2), 6, "--tp 2 x --pp 2 = 4 does not divide the world size 6"),
    (dict(tp=2, dp=3), 4, "--dp 3"),
    (dict(pp=3), 3, "--pp 3 cannot split 4 layers into equal contiguous stages; choose 1, 2 or 4"),
    (dict(pp=8), 8, "--pp 8 cannot split 4 layers"),
    (dict(dp=2, microbatches=8), 2, "--batch-size 8 must split into dp 2 x microbatches 8"),
    (dict(tp=2, sequence_parallel=True, seq_len=31), 2, "--sequence-parallel needs --seq-len 31 divisible"),
    (dict(pp=4, schedule="interleaved", virtual_stages=2, microbatches=4), 4, "--pp x --virtual-stages = 8 chunks"),
    (dict(pp=2, schedule="interleaved", virtual_stages=2, microbatches=1), 2, "--microbatches 1 a multiple of --pp"),
    (dict(schedule="interleaved", virtual_stages=2, microbatches=2), 1, "--schedule interleaved needs --pp >= 2"),
])
def test_invalid_layouts_are_refused_with_the_valid_choices(kw, world, message):
    with pytest.raises(UserError) as e:
        validate_layout(CFG, _train(**kw), world)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kw, world, named, not_named", [
    # pp is fine here (2): only the micro-batch condition failed, so only it is named
    (dict(pp=2, schedule="interleaved", virtual_stages=2, microbatches=1), 2, "--microbatches 1 a multiple of --pp",
     ("--pp >= 2", "chunks of equal size")),
    (dict(pp=4, schedule="interleaved", virtual_stages=2, microbatches=4), 4, "--pp x --virtual-stages = 8 chunks",
     ("--pp >= 2", "--microbatches")),
    (dict(schedule="interleaved", virtual_stages=2, microbatches=2), 1, "--pp >= 2 (got 1)",
     ("chunks of equal size", "--microbatches")),
])
def test_the_interleaved_refusal_names_only_the_condition_that_failed(kw, world, named, not_named):
    with pytest.raises(UserError) as e:
        validate_layout(CFG, _train(**kw), world)
    assert named in str(e.value)
    for other in not_named:
        assert other not in str(e.value), f"{other!r} is met but named: {e.value}"


def test_kv_heads_and_ffn_limit_tp():
    # tp and n_kv_heads: one must divide the other (more tp ranks than kv heads: replicas)
    cfg = dataclasses.replace(CFG, n_heads=12, n_kv_heads=3, ffn_dim=192, vocab_size=384)
    with pytest.raises(UserError, match="--tp 2 and n_kv_heads 3: one must divide the other .*; choose 1, 3, 6 or 12$"):
        validate_layout(cfg, _train(tp=2, batch_size=8), 2)
    assert validate_layout(dataclasses.replace(CFG, n_kv_heads=2), _train(tp=4), 4) == 1     # 2 ranks per kv head
    assert validate_layout(CFG, _train(tp=8), 8) == 1                                         # tiny: 4 kv heads
    cfg = dataclasses.replace(CFG, ffn_dim=170)
    with pytest.raises(UserError, match="does not divide ffn_dim 170"):
        validate_layout(cfg, _train(tp=4), 4)


def test_valid_layouts_return_dp():
    assert validate_layout(CFG, _train(tp=2, pp=2), 8) == 2
    assert validate_layout(CFG, _train(tp=4), 4) == 1


def test_interleaved_stages_list_their_chunks_in_the_layout_table():
    table = layout_table(1, 4, 1, 8, v=2)
    assert "   0   0   0   0  0-0,4-4  +embedding" in table and "   3   0   3   0  3-3,7-7  +norm,head,loss" in table


@pytest.mark.parametrize("flags, message", [
    (dict(schedule="interleaved"), "the interleaved schedule needs --virtual-stages >= 2"),
    (dict(virtual_stages=2), "--schedule 1f1b with --virtual-stages 2"),
    (dict(schedule="interleaved", virtual_stages=0), "--virtual-stages must be positive"),
])
def test_virtual_stages_only_with_the_interleaved_schedule(flags, message):
    with pytest.raises(UserError, match=message):
        _train(**flags).validate()
