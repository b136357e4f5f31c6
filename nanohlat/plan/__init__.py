"""Before a run: what each rank holds, computes and sends, and how long a step
should take (`train.py --plan`); which layouts fit and are fastest (`--search`).

Everything here is arithmetic on the config: no devices, no tensors, so it
answers for hlat-70b on 2048 ranks in a moment. The same formulas are checked
against what small real runs measure (tests/plan/test_plan_against_runs.py: the comm ledger,
the optimizer's bytes, the bytes autograd keeps after a forward), so the plan
is a prediction you can trust, not a guess.

One idea a file, in the order they build on each other:

    params.py         the parameters one rank holds, in FlatAdamW's flat groups
    memory.py         weights, optimizer state, gradient buffers, activations: the peak per rank
    context.py        --cp: each attention algorithm's bytes kept and sent, the causal work per cp rank
    communication.py  every collective per step, counted like the comm ledger
    hardware.py       device memory, the interconnects, the dp ring hop by hop
    step_time.py      compute + communication + bubble: an estimated step
    fp8_costs.py      --fp8: its amax gathers, what it keeps, the linears at the device's FP8 rate
    failures.py       a checkpoint's bytes and save time, the cluster's MTBF, the interval that loses least
    kv_cache.py       the KV cache when serving
    fmt.py            human units and aligned tables
    sheets.py         the printed plan (`--plan`), and the comm table a run prints
    layout_search.py  `--plan --search`: every layout that fits, fastest first
    measured.py       the plan beside what a run measured (its summary.json), term by term
    page_data.py      every figure of the planner page, computed by the functions above
    page.py           `--plan --html FILE`: the planner as one self-contained page

It stands on the step's tools (tools/metrics.py's FLOPs and peaks, the
optimizer's chunk, the pipeline's timetable) and below run/, whose pre-flight
refuses a model the plan says cannot fit (docs/design.md 1).

The names below are what the rest of nanohlat and the tests use
(`from nanohlat import plan; plan.report(...)`).
"""

from nanohlat.plan.communication import comm_bytes_per_step, comm_per_step, exchanges_per_boundary
from nanohlat.plan.failures import (checkpoint_bytes, interval_plan, lost_fraction, optimal_interval, rank_bytes,
                                   resolve_save_every, snapshot_bytes)
from nanohlat.plan.fmt import GiB
from nanohlat.plan.hardware import NETWORKS, Network, dp_ring, ring_hops
from nanohlat.plan.kv_cache import kv_cache_bytes
from nanohlat.plan.layout_search import candidate_layouts, search, search_report
from nanohlat.plan.memory import (PEAK_MARGIN, activation_bytes, memory_per_rank, micro_batch_size,
                                        microbatches_in_flight, moe_grouped, moe_layer_bytes, peak_memory_per_rank,
                                        weight_grad_bytes)
from nanohlat.plan.sheets import COMM_LEGEND_SHORT, comm_report, comm_table, report
from nanohlat.plan.step_time import estimate_step, recompute_flops_per_token
