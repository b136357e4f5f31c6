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
checked through the tutorial's chapter 5 transcript (tests/test_tutorial.py).
"""

from __future__ import annotations

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
