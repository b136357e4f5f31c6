"""The 1F1B pipeline schedule for pp = 4 stages and m = 8 micro-batches, written
out by hand and checked against `pipeline.py:stage_order` (run with -s to see
it printed).

Each stage's row has three phases, split by `|`:

  warm-up    pp - 1 - stage forwards: enough micro-batches in flight that the
             first backward can reach this stage without it waiting idle;
  steady     one forward, one backward ("1F1B"), so a stage never holds more
             than pp - stage micro-batches' activations (AFAB holds all m);
  cool-down  the last pp - 1 - stage backwards, as they come back.

The last stage has no warm-up: its backward follows each forward at once.
When each op runs (the ticks of the timetable, with the idle bubble) is
checked through the tutorial's chapter 5 transcript (tests/repo/test_tutorial.py).
"""

from __future__ import annotations

import pytest

from nanohlat.pipeline import stage_order

PP, M = 4, 8
ONE_F_ONE_B = [
    # warm-up  | steady                                          | cool-down
    "F0 F1 F2  | F3 B0 F4 B1 F5 B2 F6 B3 F7 B4                   | B5 B6 B7",
    "F0 F1     | F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5             | B6 B7",
    "F0        | F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6       | B7",
    "          | F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 |",
]


def ops(text: str) -> list[tuple[str, int]]:
    return [(op[0], int(op[1:])) for op in text.split()]


def in_flight(order: list[tuple[str, int]]) -> int:
    """Most micro-batches whose forward ran and whose backward has not yet."""
    most = live = 0
    for kind, _ in order:
        live += 1 if kind == "F" else -1
        most = max(most, live)
    return most


def test_1f1b_order_for_pp4_m8_is_the_hand_written_table():
    print(f"\n1F1B, pp={PP}, m={M}: warm-up | steady (1F1B) | cool-down")
    for stage, row in enumerate(ONE_F_ONE_B):
        print(f"stage {stage} | {row}")
        warmup, steady, cooldown = (ops(phase) for phase in row.split("|"))
        assert stage_order("1f1b", PP, M, stage) == warmup + steady + cooldown
        assert len(warmup) == PP - 1 - stage and {k for k, _ in warmup} <= {"F"}
        assert len(cooldown) == PP - 1 - stage and {k for k, _ in cooldown} <= {"B"}
        assert [k for k, _ in steady] == ["F", "B"] * (M - (PP - 1 - stage))


def test_each_micro_batch_goes_forward_then_backward_once_in_order():
    for stage in range(PP):
        order = stage_order("1f1b", PP, M, stage)
        forwards = [i for k, i in order if k == "F"]
        backwards = [i for k, i in order if k == "B"]
        assert forwards == backwards == list(range(M))
        assert all(order.index(("F", i)) < order.index(("B", i)) for i in range(M))


def test_1f1b_holds_pp_minus_stage_micro_batches_afab_holds_all():
    for stage in range(PP):
        assert in_flight(stage_order("1f1b", PP, M, stage)) == PP - stage
        assert in_flight(stage_order("afab", PP, M, stage)) == M
    assert stage_order("afab", PP, M, 0) == ops(" ".join(f"F{i}" for i in range(M)) + " "
                                                + " ".join(f"B{i}" for i in range(M)))


# ---------------------------------------------------------------------------
# Interleaved 1F1B (--schedule interleaved --virtual-stages v)
# ---------------------------------------------------------------------------

INTERLEAVED_PP4_M8_V2_STAGE0 = (   # warm-up 2*(4-1-0) + (2-1)*4 = 10 forwards, then 1F1B, then cool-down
    "F0 F1 F2 F3 F0.1 F1.1 F2.1 F3.1 F4 F5 | F6 B0.1 F7 B1.1 F4.1 B2.1 F5.1 B3.1 F6.1 B0 F7.1 B1 | "
    "B2 B3 B4.1 B5.1 B6.1 B7.1 B4 B5 B6 B7")


def chunk_ops(text: str) -> list[tuple[str, int, int]]:
    return [(op[0], int(op[1:].split(".")[0]), int(op.split(".")[1]) if "." in op else 0) for op in text.split()]


def test_interleaved_order_for_pp4_m8_v2_stage0_is_the_hand_written_row():
    from nanohlat.beyond.schedules import stage_ops
    warmup, steady, cooldown = (chunk_ops(p) for p in INTERLEAVED_PP4_M8_V2_STAGE0.split("|"))
    assert stage_ops("interleaved", 4, 8, 0, 2) == warmup + steady + cooldown
    assert len(warmup) == 2 * (4 - 1) + (2 - 1) * 4


@pytest.mark.parametrize("pp, m, v", [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (3, 6, 2), (4, 8, 4), (2, 6, 3)])
def test_interleaved_visits_every_chunk_once_per_micro_batch_and_never_deadlocks(pp, m, v):
    from nanohlat.beyond.schedules import stage_ops, timetable
    for stage in range(pp):
        order = stage_ops("interleaved", pp, m, stage, v)
        assert sorted(order) == sorted((k, i, c) for k in "FB" for i in range(m) for c in range(v))
        assert all(order.index(("F", i, c)) < order.index(("B", i, c)) for i in range(m) for c in range(v))
    ticks = timetable("interleaved", pp, m, v)      # raises if no stage can move in some tick
    assert sum(op is not None for row in ticks for op in row) == 2 * pp * m * v


@pytest.mark.parametrize("pp, m, v", [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (3, 6, 2), (4, 8, 4), (4, 12, 3),
                                      (8, 16, 2)])
def test_interleaved_ideal_bubble_is_its_formula_and_in_flight_its_warm_up_plus_one(pp, m, v):
    """F = 1, B = 2 units per stage, 1/v per chunk: the ideal timeline idles
    (p-1)/(v*m+p-1) of the step; stage s holds 2(p-1-s) + (v-1)p + 1 chunk activations."""
    from nanohlat.beyond.schedules import stage_ops
    from nanohlat.tools import timeline
    rows, span = timeline.ideal_timeline("interleaved", pp, m, v)
    assert span == pytest.approx(3 * m + 3 * (pp - 1) / v)
    assert timeline.ideal_bubble("interleaved", pp, m, v) == pytest.approx((pp - 1) / (v * m + pp - 1))
    assert timeline.formula_bubble(pp, m, "interleaved", v) == pytest.approx((pp - 1) / (v * m + pp - 1))
    for stage in range(pp):
        held = timeline.in_flight(stage_ops("interleaved", pp, m, stage, v))
        assert held == timeline.in_flight_formula("interleaved", pp, m, stage, v)[0] \
            == min(2 * (pp - 1 - stage) + (v - 1) * pp + 1, v * m)


def test_interleaved_pp4_m8_v2_bubble_is_016_against_1f1b_027():
    from nanohlat.tools import timeline
    assert f"{timeline.ideal_bubble('interleaved', 4, 8, 2):.2f}" == "0.16"
    assert f"{timeline.ideal_bubble('1f1b', 4, 8):.2f}" == "0.27"


def test_chunks_of_an_interleaved_stage():
    """8 layers, pp 4, v 2: chunk k = c*pp + s holds layer k; stage 1 holds layers 1 and 5."""
    from nanohlat.beyond.schedules import chunk_layers, stage_layers
    assert [list(chunk_layers(8, 4, 1, c, 2)) for c in range(2)] == [[1], [5]]
    assert stage_layers(8, 4, 1, 2) == [1, 5] and stage_layers(8, 2, 0, 2) == [0, 1, 4, 5]
    assert stage_layers(8, 4, 1) == [2, 3]


def tick_kinds(schedule: str, pp: int, m: int, v: int, stage: int) -> set:
    """What decides the graph XLA compiles for one tick of `stage` (the runner
    cuts a graph per tick): its op's kind and chunk (the chunk's layers, the
    embedding or the loss), and on each boundary it uses whether an
    activation and a gradient cross. The micro-batch index is not in it: each
    micro-batch is its own device tensor (PipelineRunner.run's docstring)."""
    from nanohlat.beyond.schedules import timetable
    kinds = set()
    for row in timetable(schedule, pp, m, v):
        op = row[stage]
        sends = lambda o, kind, chunk_ok=lambda c: True: o is not None and o[0] == kind and chunk_ok(o[2])
        left = (sends(row[stage - 1], "F"), sends(op, "B")) if stage > 0 else None
        right = (sends(op, "F"), sends(row[stage + 1], "B")) if stage < pp - 1 else None
        wrap = ((sends(row[-1], "F", lambda c: c < v - 1), sends(row[0], "B", lambda c: c > 0))
                if v > 1 and stage in (0, pp - 1) else None)
        kinds.add(((op[0], op[2]) if op else None, left, right, wrap))
    return kinds


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb-h1", 1)])
def test_distinct_tick_graphs_do_not_grow_with_the_micro_batches(schedule, v):
    """pp 4: from m = 2pp on (the steady state reached) every stage has the same
    set of distinct ticks for m = 8, 16 and 32, so XLA compiles as many tick
    graphs for 32 micro-batches as for 8 (interleaved v = 2: 13 to 14 per stage)."""
    for stage in range(4):
        assert tick_kinds(schedule, 4, 8, v, stage) == tick_kinds(schedule, 4, 16, v, stage) \
            == tick_kinds(schedule, 4, 32, v, stage)


# ---------------------------------------------------------------------------
# ZB-H1 (--schedule zb-h1): B = the input gradient, W = the weight gradients
# ---------------------------------------------------------------------------

ZB_H1_PP4_M8 = [   # 1F1B's F and B; stage s runs W(j) after B(j+s)
    "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7",
    "F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7",
    "F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7",
    "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7",
]


def test_zb_h1_order_for_pp4_m8_is_the_hand_written_table():
    from nanohlat.beyond.schedules import stage_ops
    for stage, row in enumerate(ZB_H1_PP4_M8):
        assert stage_ops("zb-h1", PP, M, stage) == chunk_ops(row)
        # without the W's it is 1F1B's order
        assert [(k, i) for k, i, _ in chunk_ops(row) if k != "W"] == stage_order("1f1b", PP, M, stage)


@pytest.mark.parametrize("pp, m", [(1, 1), (1, 4), (2, 2), (2, 5), (3, 3), (3, 7), (4, 4), (4, 8), (4, 13), (8, 8),
                                   (8, 16)])
def test_zb_h1_ideal_bubble_is_its_formula_and_every_stage_holds_p(pp, m):
    """F = B = W = 1 unit: the ideal timeline (and the tick engine: all ops are
    1 unit) idles (p-1)/(3m+p-1); 1F1B with F = 1, B = 2 idles (p-1)/(m+p-1).
    Every stage holds p micro-batches from its F to its W; W(i) needs only its
    own stage's B(i), so no stage ever waits on a W."""
    from nanohlat.beyond.schedules import depends_on, stage_ops, timetable
    from nanohlat.tools import timeline
    ticks = timetable("zb-h1", pp, m)
    assert len(ticks) == 3 * m + pp - 1
    assert timeline.ideal_timeline("zb-h1", pp, m)[1] == 3 * m + pp - 1
    assert timeline.ideal_bubble("zb-h1", pp, m) == pytest.approx((pp - 1) / (3 * m + pp - 1))
    assert timeline.formula_bubble(pp, m, "zb-h1") == pytest.approx((pp - 1) / (3 * m + pp - 1))
    assert timeline.lockstep_bubble(ticks, m) == pytest.approx((pp - 1) / (3 * m + pp - 1))
    for stage in range(pp):
        order = stage_ops("zb-h1", pp, m, stage)
        assert sorted(order) == sorted((k, i, 0) for k in "FBW" for i in range(m))
        assert all(order.index(("B", i, 0)) < order.index(("W", i, 0)) for i in range(m))
        assert timeline.in_flight(order) == timeline.in_flight_formula("zb-h1", pp, m, stage)[0] == pp
        for op in order:
            dep = depends_on(op, stage, pp)
            assert (dep[1] == stage) if op[0] == "W" else (dep is None or dep[0] != "W")


def test_zb_h1_pp4_m8_bubble_is_011_against_1f1b_027():
    from nanohlat.tools import timeline
    assert f"{timeline.ideal_bubble('zb-h1', 4, 8):.2f}" == "0.11"
    assert f"{timeline.formula_bubble(4, 8, 'zb-h1'):.2f}" == "0.11"


@pytest.mark.parametrize("tick", ["B", "W"])
def test_an_exception_in_a_zb_h1_tick_leaves_the_next_backward_whole(tick):
    """The split-backward mode belongs to the PipelineRunner running the ticks
    (schedules.py:ZeroBubbleRunner, split_backward.py:SplitBackward): the model's linears defer
    their weight gradients only inside its run, however the run ends. Here a
    parameter hook raises in the middle of a zb-h1 step (pp 1, 2 micro-batches):
    in a B (the embedding's gradient comes in B), or in a W (wq's comes in W),
    while every linear holds the runner's SplitBackward. After it every linear
    holds None again; the next plain backward is whole: every parameter gets its
    gradient, bitwise a fresh model's; and the next zb-h1 step of the same runner
    is bitwise a 1F1B step of a fresh model (nothing the failed B stashed is used)."""
    import dataclasses
    import torch
    from nanohlat import device, tensor_parallel as tpl
    from nanohlat.beyond import schedules, split_backward
    from nanohlat.recipe import PRESETS, TrainConfig
    from nanohlat.mesh import Mesh
    from nanohlat.model import Transformer, init_weights
    cfg = dataclasses.replace(PRESETS["tiny"][0], n_layers=2)
    mesh, dev = Mesh(1, 1, 1).build_groups(None), device.get_device("cpu")
    g = torch.Generator().manual_seed(7)
    tokens, targets = ([torch.randint(0, cfg.vocab_size, (2, 16), generator=g) for _ in range(2)] for _ in range(2))

    def runner(schedule):
        model = Transformer(cfg)
        if schedule == "zb-h1":
            split_backward.apply(model)   # (as run/build.py does)
        init_weights(model, 0)
        t = dataclasses.replace(TrainConfig(), batch_size=4, seq_len=16, microbatches=2, schedule=schedule)
        return schedules.runner(schedule)(model, mesh, t, (2, 16, cfg.d_model), torch.float32, dev)

    def linears(model):
        return [m for m in model.modules() if isinstance(m, (tpl.ColumnParallelLinear, tpl.RowParallelLinear))]

    def grads(model):
        return {n: p.grad for n, p in model.named_parameters()}

    zb = runner("zb-h1")
    model = zb.model
    held = []

    def boom(p):
        held.append([m.split for m in linears(model)])
        raise KeyError(f"planted in a {tick} tick")
    name = "embed.weight" if tick == "B" else "layers.0.attn.wq.weight"
    hook = dict(model.named_parameters())[name].register_post_accumulate_grad_hook(boom)
    with pytest.raises(KeyError, match=f"planted in a {tick} tick"):
        zb.run(tokens, targets, 1.0)
    hook.remove()
    assert held and all(s is zb.split for s in held[0]), "the hook ran inside the split step"
    assert all(m.split is None for m in linears(model)), "a linear still defers after the failed step"
    assert zb.split.stash == []

    # the next backward outside the runner: whole, every gradient there and a fresh model's
    fresh = runner("1f1b").model
    for m in (model, fresh):
        for p in m.parameters():
            p.grad = None
        m(tokens[0], targets[0]).sum().backward()
    want = grads(fresh)
    assert all(p is not None for p in grads(model).values())
    assert all(torch.equal(p, want[n]) for n, p in grads(model).items())

    # the same runner's next zb-h1 step: bitwise 1F1B's on a fresh model
    one_f_one_b = runner("1f1b")
    for r in (zb, one_f_one_b):
        for p in r.model.parameters():
            p.grad = None
    assert torch.equal(zb.run(tokens, targets, 1.0), one_f_one_b.run(tokens, targets, 1.0))
    want = grads(one_f_one_b.model)
    assert all(torch.equal(p, want[n]) for n, p in grads(model).items())


def test_the_timetable_follows_the_dependencies_it_is_given():
    """pipeline.timetable lays orders out by the `depends` it is handed (schedules.py hands its own, with
    the W ops'): with none, stage 1 runs its F0 in tick 0; with pipeline.depends_on, only after stage 0's."""
    from nanohlat.pipeline import stage_ops, timetable
    orders = [stage_ops("1f1b", 2, 2, s) for s in range(2)]
    assert timetable(orders, 2)[0][1] is None
    assert timetable(orders, 2, depends=lambda *_: None)[0][1] == ("F", 0, 0)
