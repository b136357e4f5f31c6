"""The checks behind `python -m nanohlat.classroom check`: one oracle per exercise.

Every check returns None (pass) or a verdict a student can act on: what was
computed, on which rank, where it first differs from the oracle and by how
much. The oracles are written in this package, independently of the code they check:
plain dense PyTorch for the parallel layers, hand-derived timetables for the
schedules, exhaustive enumeration for the mesh. A check never compares the
student's code with itself.

A verdict on the student's code starts with the name of the case that caught
it ("large logits (about +-95, padding logits 100)", "odd NaN and infinity
bit patterns", "kv heads shared by ranks (tp > n_kv_heads)"): realistic and
hostile inputs and every code path of the exercised function are cases of
their own, so a student sees which one. (Not "not done yet", a stub's, nor a
hang's, which names the ranks that never finished.)

An exercise that moves data is checked on what it moves, too, once its values
are right (wire.py:Wire): every collective a rank calls is recorded where it
enters torch.distributed, and its kind, its process group, the number of
calls and the bytes a ring implementation puts on the wire are held against
the oracle's ("right values, but 1536 bytes on the wire where 768 suffice").
A cheaper way to the same values passes; a dearer one, or one on the wrong
group, fails. (The bucketed 3a-3d must also make exactly one call per bucket.)

And how a value was made, where the right one can come the wrong way: each
call is stamped with whether it was started asynchronously and when it was
waited (3d with overlap: started in the hook, waited later), and the tensors
handed to the student's code are compared afterwards with copies taken
before (grading.py:untouched): a custom autograd Function that writes into
its input without ctx.mark_dirty, or into its incoming gradient, gets the
right values today and wrong gradients in another graph.

Distributed checks run `world` gloo processes on the CPU (grading.py:spawn); each
returns its own verdict, and the first failing rank's is reported. A rank
stuck in a collective that its peers never called is stopped at the time
limit, and the verdict says so: it is the typical symptom of a collective
called on some ranks only.

Where things are: grading.py (verdicts, the gloo workers), wire.py (what a
rank moves), then one file of oracles per chapter of tutorial.md, in its
order: ch1_transformer.py, ch3_data_parallel.py, ch4_tensor_parallel.py,
ch5_pipeline.py, ch6_mesh.py, ch7_precision.py, ch7_fp8.py, ch8_checkpoints.py,
ch10_moe.py, ch11_context_parallel.py. This
file runs an exercise's checks (`run`) and lists them (`CHECKS`).
"""

from __future__ import annotations

from nanohlat.classroom.checks.grading import _CASE, explain
from nanohlat.classroom.checks.ch1_transformer import check_kv_cache, check_rmsnorm, check_rotary
from nanohlat.classroom.checks.ch3_data_parallel import check_all_gather, check_all_reduce, check_reduce_scatter, check_zero2_bucket, check_zero3_gather
from nanohlat.classroom.checks.ch4_tensor_parallel import check_conjugates, check_cross_entropy, check_linears
from nanohlat.classroom.checks.ch5_pipeline import check_1f1b, check_exchange_plan, check_interleaved
from nanohlat.classroom.checks.ch6_mesh import check_coords, check_groups
from nanohlat.classroom.checks.ch7_precision import check_stochastic_rounding
from nanohlat.classroom.checks.ch7_fp8 import check_block_amax_over_ranks, check_fp8_cast, check_mx_scale
from nanohlat.classroom.checks.ch8_checkpoints import check_background_save, check_reshard
from nanohlat.classroom.checks.ch10_moe import check_dispatch, check_ep_groups, check_route
from nanohlat.classroom.checks.ch11_context_parallel import check_merge, check_ring_backward, check_zigzag


def run(ex, on_start=None) -> str | None:
    """Run every check of exercise `ex`; the first verdict, or None when all pass. `on_start(name)`
    as each check starts (isolate.serve: each has its time limit)."""
    for check in CHECKS[ex.id]:
        _CASE["name"] = None
        if on_start:
            on_start(check.__name__)
        try:
            verdict = check()
        except Exception as e:   # the student's code raised (NotImplementedError for the stub)
            return explain(e, ex.id)
        if verdict:
            return verdict if not verdict.startswith("not done yet") else explain(Exception(verdict), ex.id)
    return None


CHECKS = {
    "1a": [check_rmsnorm],
    "1b": [check_rotary],
    "1c": [check_kv_cache],
    "3a": [check_all_reduce],
    "3b": [check_reduce_scatter],
    "3c": [check_all_gather],
    "3d": [check_zero2_bucket],
    "3e": [check_zero3_gather],
    "4a": [check_conjugates],
    "4b": [check_linears],
    "4c": [check_cross_entropy],
    "5a": [check_1f1b],
    "5b": [check_exchange_plan],
    "5c": [check_interleaved],
    "6a": [check_coords],
    "6b": [check_groups],
    "7a": [check_stochastic_rounding],
    "7b": [check_fp8_cast],
    "7c": [check_mx_scale, check_block_amax_over_ranks],
    "8a": [check_reshard],
    "8b": [check_background_save],
    "10a": [check_route],
    "10b": [check_dispatch],
    "10c": [check_ep_groups],
    "11a": [check_merge],
    "11b": [check_zigzag],
    "11c": [check_ring_backward],
}
