"""The figures drawn from something that runs: what torch.compile counts (chapter 2), bf16 rounding
over many updates (7), a continuous-batching server's slots (9), a mixture's expert load over short
training runs (10) and the debugging lab's compare of two runs (12).

Counts (graphs, slots, rounded bf16 values summed exactly) are the same on every machine. The two
figures that train (`moe_load`, `lab_compare`) add floats in an order another CPU's kernels may change:
their numbers agree across machines only to a tolerance, which the test states (TRAINED).
"""

from __future__ import annotations

import os

import torch

from nanohlat.tools import svg

# ---------------------------------------------------------------------------
# Chapter 2: what torch.compile counts, compile_lessons' three lessons
# ---------------------------------------------------------------------------


def compile_lessons_data() -> dict:
    """Graphs compiled and graph breaks over the lessons' 6 steps, for each way of writing each step
    (classroom/compile_lessons.py's own functions, run as its command runs them; the same counts under
    torch 2.9 and 2.13: tests/tools/test_compile.py holds them in both lanes)."""
    from nanohlat.classroom import compile_lessons as cl
    cases = (("lr float, dynamic=False", cl.sgd, False, cl.gradients(), False),
             ("lr float, automatic dynamic", cl.sgd, False, cl.gradients(), None),
             ("lr a 0-d tensor", cl.sgd, True, cl.gradients(), None),
             ("if on the value", cl.skip_with_if, True, cl.gradients(2), None),
             ("keep mask", cl.skip_with_mask, True, cl.gradients(2), None),
             ("norm.item() on host", cl.clip_on_host, True, cl.gradients(), None),
             ("torch.clamp on device", cl.clip_on_device, True, cl.gradients(), None))
    out = {}
    for label, fn, as_tensor, grads, dynamic in cases:
        r = cl.run_compiled(fn, as_tensor, grads, dynamic)
        out[label] = {"graphs compiled": r["graphs"], "graph breaks": r["graph_breaks"]}
    return {"steps": cl.STEPS, "cases": out}


def compile_lessons_svg(data: dict) -> str:
    return svg.grouped_bars([(label, list(c.items())) for label, c in data["cases"].items()], "count",
                            width=560, title=f"torch.compile over {data['steps']} steps of each way of "
                                             f"writing it: graphs and breaks")


# ---------------------------------------------------------------------------
# Chapter 7: small updates under bf16, rounded to nearest or stochastically
# ---------------------------------------------------------------------------

def precision_data(steps: int = 300, n: int = 4096, update: float = 1e-3) -> dict:
    """`n` weights starting at 1.0 (an RMSNorm gain) each take `steps` updates of -`update` (lr x
    |m / sqrt(v)| ~ lr), kept in fp32, in bf16 rounded to nearest (precision.py:round_update) and in
    bf16 rounded stochastically with the optimizer's own noise (precision.py:rounding_noise, keyed by
    seed, step and name as round_into_master keys it). The mean weight after each step: bf16 values
    near 1 have 8 significant bits, so their float64 sum is exact in any order."""
    from nanohlat import precision as pr
    index = torch.arange(n, dtype=torch.int64)
    w32 = torch.ones(n)
    rne = torch.ones(n, dtype=torch.bfloat16)
    sr = torch.ones(n, dtype=torch.bfloat16)
    rows = {"fp32": [], "bf16, round to nearest": [], "bf16, stochastic rounding": []}
    for step in range(1, steps + 1):
        w32 = w32 - update
        rne = pr.round_update(rne.float() - update, torch.bfloat16, "bf16")
        key = pr.mix64(pr.step_key(0, torch.tensor(step)) ^ pr.name_key("layers.0.attn_norm.weight"))
        sr = pr.stochastic_round_to_bf16(sr.float() - update, noise=pr.rounding_noise(key, index))
        for name, w in zip(rows, (w32, rne, sr)):
            rows[name].append(float(w.double().sum()) / n)
    every = max(steps // 60, 1)
    return {"update": update, "weights": n, "steps": list(range(every, steps + 1, every)),
            "mean_weight": {k: [round(v[s - 1], 12) for s in range(every, steps + 1, every)] for k, v in rows.items()}}


def precision_svg(data: dict) -> str:
    return svg.line_chart({k: list(zip(data["steps"], v)) for k, v in data["mean_weight"].items()}, "update",
                          "mean weight", width=600, title=f"{data['weights']} weights from 1.0, each update "
                                                          f"-{data['update']:g}: what bf16 keeps")


# ---------------------------------------------------------------------------
# Chapter 9: continuous batching, slot by slot
# ---------------------------------------------------------------------------

def serving_slots_data(n: int = 12, slots: int = 4) -> dict:
    """serving/server.py:serve_continuous on a stream of `n` requests (arrival_stream), its clock
    counting model passes (a prefill of the newcomers, or one decode step of every slot, is one pass)
    instead of seconds: which request held each slot from which pass to which. Every request stops at
    its own max_new_tokens, so the schedule does not depend on the (random) weights' tokens."""
    from nanohlat import recipe
    from nanohlat.model import init_weights
    from nanohlat.run.build import decoder
    from nanohlat.serving import server

    class Passes(server.Clock):
        def __init__(self):
            super().__init__()
            self.admitted = []

        def run(self, fn, *args):
            if fn is server._admit:           # (model, cache, slots, requests)
                self.admitted += [(s, r.id, self.now) for s, r in zip(args[2], args[3])]
            self.now += 1
            return fn(*args)

    cfg, tcfg = recipe.parse_args(["--preset", "tiny"])
    model = decoder(cfg)
    init_weights(model, tcfg.seed)
    model.eval()
    reqs = server.arrival_stream(n, 0.4, cfg.vocab_size, seed=1, prompt_len=(4, 12), new_tokens=(3, 18))
    clock, threads = Passes(), torch.get_num_threads()
    torch.set_num_threads(1)   # matmuls of a few rows: threads only wait for each other (on a busy machine, long)
    try:
        with torch.no_grad():
            stats = server.serve_continuous(model, reqs, slots, clock)
    finally:
        torch.set_num_threads(threads)
    by_id = {r.id: r for r in reqs}
    return {"slots": slots, "passes": clock.now, "tokens": stats["tokens"],
            "requests": [{"id": i, "slot": s, "arrival": round(by_id[i].arrival, 6), "admitted": t,
                          "finished": by_id[i].finish, "new_tokens": by_id[i].max_new_tokens}
                         for s, i, t in clock.admitted]}


def serving_slots_svg(data: dict) -> str:
    rows = [(f"slot {s}", [(r["admitted"], r["finished"], f"r{r['id']}", r["id"] % 7) for r in data["requests"]
                           if r["slot"] == s]) for s in range(data["slots"])]
    waits = [(f"r{r['id']}", [(r["arrival"], r["admitted"], "", 7), (r["admitted"], r["finished"], "", r["id"] % 7)])
             for r in sorted(data["requests"], key=lambda r: r["id"])]
    return svg.panels([
        svg.gantt(rows, "model passes (a prefill of the newcomers or one decode step of every slot)", width=680,
                  title=f"{data['slots']} slots: a request joins at the next pass after a slot frees"),
        svg.gantt(waits, "model passes: grey, waiting for a slot; colour, in a slot", width=680,
                  title="each request, from its arrival")],
        title=f"Continuous batching: {len(data['requests'])} requests, {data['tokens']} tokens, the last done "
              f"at pass {data['passes']:.1f}")


# ---------------------------------------------------------------------------
# Training runs: the lab's workers run them (classroom/lab_workers.py)
# ---------------------------------------------------------------------------

def _train(jobs: dict, read=None) -> dict:
    """{key: read(the run's out-dir)} (default: its step rows, lab.read_steps) for {key: (train.py flags,
    processes, {file: text})}, each run by the debugging lab's workers (one-process runs two at a
    time) in a scratch folder, which is gone afterwards."""
    from nanohlat.classroom import lab, lab_workers
    from nanohlat.config import UserError
    with lab_workers.Pools() as pools:
        done = pools.run([lab_workers.Job(k, lab_workers.GRADER, [flags], world, texts)
                          for k, (flags, world, texts) in jobs.items()])
        out = {}
        for k, result in done.items():
            if "error" in result:
                raise UserError(f"the figure's run {k} failed: {result['error']}")
            out[k] = (read or lab.read_steps)(result["out"])
    return out


LEDGER_FLAGS = ["--preset", "tiny", "--steps", "1", "--eval-every", "0", "--no-progress", "--threads", "1",
                "--nproc", "2", "--tp", "2", "--sequence-parallel"]


def ledger_data() -> dict:
    """Chapter 4's second run (tp 2, sequence parallel), one step: what its comm ledger counted on rank
    0 in the first step, per collective (summary.json, run/trainlog.py:comm_summary), beside what the
    plan predicts for that rank (plan/communication.py:comm_per_step)."""
    import dataclasses
    import json

    from nanohlat import recipe
    from nanohlat.mesh import Mesh
    from nanohlat.plan.communication import comm_per_step

    def read(out):
        with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
            return json.load(f)

    summary = _train({"tp 2, sp": (LEDGER_FLAGS, 2, {})}, read)["tp 2, sp"]
    cfg, tcfg = recipe.parse_args(LEDGER_FLAGS)
    tcfg = dataclasses.replace(tcfg, dp=tcfg.nproc // (tcfg.tp * tcfg.pp), device="cpu")   # as pre-flight settles them
    plan = comm_per_step(cfg, tcfg, Mesh(tcfg.tp, tcfg.pp, tcfg.dp, 0))
    keys = sorted(set(plan) | set(summary["comm_bytes"]))
    names = {"payload": "comm_bytes", "wire": "comm_wire_bytes", "calls": "comm_calls"}
    return {"flags": " ".join(LEDGER_FLAGS[:2] + LEDGER_FLAGS[-5:]), "collectives": {
        k: {"ledger": {f: summary[name].get(k, 0) for f, name in names.items()},
            "plan": {f: plan.get(k, {}).get(f, 0) for f in names}} for k in keys}}


def ledger_svg(data: dict) -> str:
    same = sum(c["ledger"] == c["plan"] for c in data["collectives"].values())
    return svg.grouped_bars([(f"{k} ({c['ledger']['calls']} calls)",
                              [(f"{who} {f}", c[who][f]) for f in ("payload", "wire") for who in ("ledger", "plan")])
                             for k, c in data["collectives"].items()], "bytes in the first step, rank 0", width=600,
                            title=f"{data['flags']}: the ledger against the plan, {same} of "
                                  f"{len(data['collectives'])} collectives the same")


MOE_STEPS = 20
MOE_RUNS = {"aux 0: neither": ("--moe-aux-coef", "0"),
            "aux 0.01: balance loss": (),
            "aux 0, bias rate 1e-2": ("--moe-aux-coef", "0", "--moe-bias-rate", "1e-2")}


def moe_load_data() -> dict:
    """The moe preset trained MOE_STEPS steps three ways; per step, what metrics.jsonl logs of the
    experts' load: moe_load_max (the busiest expert's tokens over the mean's, worst layer) and
    moe_load_cv (the tokens per expert's standard deviation over their mean)."""
    base = ["--preset", "moe", "--steps", str(MOE_STEPS), "--eval-every", "0", "--no-progress", "--threads", "1"]
    rows = _train({k: (base + list(extra), 1, {}) for k, extra in MOE_RUNS.items()})
    logged = ("moe_load_max", "moe_load_cv")
    return {"steps": MOE_STEPS, "runs": {k: {f: [round(r[f], 6) for r in rows[k]] for f in logged} for k in MOE_RUNS}}


def moe_load_svg(data: dict) -> str:
    steps = range(1, data["steps"] + 1)
    return svg.panels([
        svg.line_chart({k: list(zip(steps, v[f])) for k, v in data["runs"].items()}, "step", f, width=520,
                       title=title)
        for f, title in (("moe_load_max", "the busiest expert's load / the mean's (1: balanced, 2: the most top-2 "
                                          "of 4 allows)"),
                         ("moe_load_cv", "the spread of the experts' loads (0: balanced)"))],
        title=f"The moe preset, {data['steps']} steps three ways: the experts' load")


LAB_FLAGS = ["--preset", "tiny", "--steps", "4", "--eval-every", "0", "--no-progress", "--threads", "1",
             "--warmup-steps", "1"]


def lab_compare_data() -> dict:
    """What `python -m nanohlat.classroom compare` sets side by side, for chapter 12's worked example:
    one process, dp 2, and dp 2 with the lab's bug 0 planted (lab.planted, run by the lab's own
    workers), 4 steps each; per step the loss and grad norm, and the first step at which each dp 2
    run differs from one process by more than the lab's REL_TOL."""
    from nanohlat.classroom import lab, lab_bugs
    bug = next(b for b in lab_bugs.BUGS if b.n == 0)
    dp2 = LAB_FLAGS + ["--nproc", "2", "--dp", "2"]
    runs = {"one process": (LAB_FLAGS, 1, {}), "dp 2": (dp2, 2, {}), "dp 2, bug 0": (dp2, 2, lab.planted(bug))}
    rows = _train(runs)
    out = {k: {f: [round(r[f], 6) for r in rows[k]] for f in ("loss", "grad_norm")} for k in runs}
    for k in ("dp 2", "dp 2, bug 0"):   # (as compare judges them: on the logged figures, not the rounded ones)
        differs = [r["step"] for r, ref in zip(rows[k], rows["one process"])
                   if any(not abs(r[f] - ref[f]) <= lab.REL_TOL * abs(ref[f]) for f in ("loss", "grad_norm"))]
        out[k]["first_step_differing"] = differs[0] if differs else None
    return {"rel_tol": lab.REL_TOL, "runs": out}


def lab_compare_svg(data: dict) -> str:
    runs = data["runs"]
    steps = range(1, len(runs["one process"]["loss"]) + 1)
    said = "; ".join(f"{k}: " + (f"differs from step {r['first_step_differing']}" if r["first_step_differing"]
                                 else "agrees at every step") for k, r in runs.items() if k != "one process")
    return svg.panels([svg.line_chart({k: list(zip(steps, r[f])) for k, r in runs.items()}, "step", f, width=420,
                                      title=f) for f in ("loss", "grad_norm")], columns=2,
                      title=f"compare, against one process (rel. tol. {data['rel_tol']:g}): {said}")

