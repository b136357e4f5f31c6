"""A run's report page, `<out-dir>/report.html`: the run's figures drawn from its own files.

What a run writes is text a reader greps (metrics.jsonl, summary.json, config.json,
timeline.txt); this page draws the same records as figures, on one page that opens
in any browser without a network (inline SVG from tools/svg.py, no script, no CDN):

  * the training and held-out loss (a mixture's router losses beside it), the
    gradient norm against --grad-clip, the learning rate, tokens/s and MFU
    (metrics.jsonl);
  * the bytes rank 0 keeps against the plan's (summary.json beside
    plan.memory_per_rank), the comm ledger of the first step per collective
    against the plan's (summary.json beside plan.comm_per_step);
  * the pipeline's ideal and measured timeline of the last step (timeline.json,
    with --timeline), the experts' load (a mixture's metrics), the checkpoints,
    the logged steps whose loss or gradient was not finite, and eval.py's table
    (eval.json).

Every number on the page is read from those files, never from the process that
trained: a report of a finished run, written again, is the same page, and `compare`
(classroom/lab.py) draws two runs' pages side by side from their folders.

When: rank 0 writes it at each evaluation and at the end of the run
(run/trainlog.py), eval.py after writing eval.json. Through files.write_text like
every run file (atomic, never through a link). A page that cannot be drawn or
written never costs a step: `write_quietly` says so in one warning and training
goes on (docs/robustness.md); a file that is missing or damaged leaves its section
saying so, the rest is drawn.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from html import escape

from nanohlat.plan.fmt import fmt_bytes
from nanohlat.system import cli, files
from nanohlat.tools import svg

REPORT = "report.html"
MAX_POINTS = 1000   # a curve draws at most this many of its points (every k-th, and always the last)


# ---------------------------------------------------------------------------
# Reading the run's files
# ---------------------------------------------------------------------------

def _number(v) -> float:
    """A logged number as a float: a JSON number, or the strings "NaN"/"Infinity" (files.json_text)."""
    if isinstance(v, bool) or v is None:
        return math.nan
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _json(path: str, notes: list) -> dict | None:
    """A JSON object file, or None (absent: silently; unreadable: a note)."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
        if not isinstance(obj, dict):
            raise ValueError("not a JSON object")
        return obj
    except (OSError, ValueError) as e:
        notes.append(f"{os.path.basename(path)} is unreadable ({e}): its figures are left out")
        return None


def read_run(out_dir: str) -> dict:
    """The run's records: config, summary, timeline, eval (dicts or None), `steps` (the
    metrics.jsonl rows with a loss), `vals` (those with a val_loss), `checkpoints`
    ([(step, tokens, folder)]) and `notes` (what could not be read)."""
    notes: list[str] = []
    run = {"dir": out_dir, "notes": notes, "steps": [], "vals": []}
    for name in ("config", "summary", "timeline", "eval"):
        run[name] = _json(os.path.join(out_dir, name + ".json"), notes)
    path, damaged = os.path.join(out_dir, "metrics.jsonl"), 0
    if os.path.isfile(path):
        with open(path, "rb") as f:
            for raw in f:
                try:
                    row = json.loads(raw.decode())
                except ValueError:
                    damaged += raw.strip() != b""
                    continue
                if isinstance(row, dict) and isinstance(row.get("step"), int):
                    if "loss" in row:
                        run["steps"].append(row)
                    elif "val_loss" in row:
                        run["vals"].append(row)
                    elif "restart" in row:   # a launcher's restart after a failure (run/restarts.py)
                        run.setdefault("restarts", []).append(row)
    if damaged:
        notes.append(f"metrics.jsonl has {damaged} damaged line(s), left out")
    from nanohlat.run.checkpoint import list_checkpoints, step_of
    for folder in list_checkpoints(out_dir):
        manifest = _json(os.path.join(folder, "manifest.json"), notes) or {}
        run.setdefault("checkpoints", []).append((step_of(folder), manifest.get("tokens"), os.path.basename(folder)))
    return run


def configs(run: dict):
    """(ModelConfig, TrainConfig) of the run's config.json, or None when it has none or they do not build."""
    from nanohlat.recipe import ModelConfig, TrainConfig
    cfg = run["config"]
    if not cfg or not isinstance(cfg.get("model"), dict) or not isinstance(cfg.get("train"), dict):
        return None
    try:
        model = ModelConfig(**{f.name: cfg["model"][f.name] for f in dataclasses.fields(ModelConfig)
                               if f.name in cfg["model"]})
        train = TrainConfig(**{f.name: cfg["train"][f.name] for f in dataclasses.fields(TrainConfig)
                               if f.name in cfg["train"]})
        return model, train
    except (TypeError, ValueError) as e:
        run["notes"].append(f"config.json does not describe a run ({e}): the plan's figures are left out")
        return None


# ---------------------------------------------------------------------------
# Sections: (id, title, html) each; a run's page is their sequence
# ---------------------------------------------------------------------------

def _table(header: list[str], rows: list[list], data: list[str] | None = None) -> str:
    """An HTML table; `data`: a data-report name per column for its cells (tests read them)."""
    names = data or [None] * len(header)
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join((f'<td data-report="{n}">' if n else "<td>") + f"{escape(str(c))}</td>"
                                    for n, c in zip(names, r)) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _caption(text: str) -> str:
    return f'<p class="caption">{escape(text)}</p>'


def _curve(rows: list[dict], key: str) -> list[tuple[float, float]]:
    """(step, value) of every row that logged `key` (a non-finite value stays: the chart leaves a gap)."""
    return [(r["step"], _number(r[key])) for r in rows if key in r and r[key] is not None]


def _thin(points: list) -> tuple[list, int]:
    """At most MAX_POINTS of `points`: every k-th and the last. Returns (points, k)."""
    k = max(1, -(-len(points) // MAX_POINTS))
    if k == 1:
        return points, 1
    return points[::k] + ([points[-1]] if (len(points) - 1) % k else []), k


def _chart(series: dict, x_label: str, y_label: str, title: str) -> tuple[str, str]:
    """A line chart of `series`, thinned; returns (svg, a sentence on the thinning or '')."""
    thinned, said = {}, ""
    for name, pts in series.items():
        thinned[name], k = _thin(pts)
        if k > 1:
            said = f" Every {k}-th logged step is drawn (and the last), of {len(pts):,}."
    return svg.line_chart(thinned, x_label, y_label, title=title), said


def _fmt(v, digits: int = 4) -> str:
    x = _number(v)
    return "n/a" if v is None else f"{x:.{digits}f}" if math.isfinite(x) else str(v)


def overview(run: dict) -> tuple[str, str, str]:
    cfg, steps, vals = run["config"] or {}, run["steps"], run["vals"]
    t = cfg.get("train", {}) if isinstance(cfg.get("train"), dict) else {}
    layout = (f"tp {t.get('tp')} x pp {t.get('pp')} x dp {cfg.get('dp')}"
              + (f" x cp {t.get('cp')}" if t.get("cp", 1) != 1 else "")
              + (f", ep {t.get('ep')}" if t.get("ep", 1) != 1 else "")) if t else "?"
    last = steps[-1] if steps else {}
    rows = [["run folder", run["dir"]], ["preset", t.get("preset", "?")],
            ["device", f"{cfg.get('device_kind', t.get('device', '?'))} ({cfg.get('device_name', '?')})"],
            ["layout (ranks)", f"{layout}; {cfg.get('world', '?')} in all"],
            ["ZeRO, schedule, precision", f"{t.get('zero', '?')}, {t.get('schedule', '?')} "
             f"(m {t.get('microbatches', '?')}), {t.get('precision', '?')}"],
            ["steps trained (of --steps)", f"{last.get('step', 0)} (of {t.get('steps', '?')})"],
            ["tokens seen", f"{last.get('tokens', 0):,}" if isinstance(last.get("tokens"), int) else "?"],
            ["final training loss", _fmt(last.get("loss")) if steps else "no step logged"],
            ["final held-out loss", f"{_fmt(vals[-1]['val_loss'])} (step {vals[-1]['step']})" if vals else "none"]]
    keys = [None, None, None, None, None, "steps", "tokens", "final-loss", "final-val-loss"]
    body = ("<table>" + "".join(f'<tr><th>{escape(k)}</th><td data-report="{d}">{escape(str(v))}</td></tr>'
                                if d else f"<tr><th>{escape(k)}</th><td>{escape(str(v))}</td></tr>"
                                for (k, v), d in zip(rows, keys)) + "</table>")
    body += "".join(f'<p class="note">note: {escape(n)}</p>' for n in run["notes"])
    return "overview", "The run", body


def loss_section(run: dict) -> tuple[str, str, str]:
    steps, vals = run["steps"], run["vals"]
    chart, said = _chart({"training loss": _curve(steps, "loss"), "held-out loss": _curve(vals, "val_loss")},
                         "step", "loss (nats per token)", "loss")
    body = chart + _caption("Cross-entropy in nats per token: training, the mean over each step's global batch "
                            "(metrics.jsonl's loss); held-out, the mean over --eval-batches fixed validation "
                            "batches every --eval-every steps (val_loss). A gap is a step whose loss was not "
                            "finite." + said)
    router = _curve(steps, "moe_router_loss")
    if router:
        chart, said = _chart({"router losses": router}, "step", "router losses (added to the loss)",
                             "router losses of the mixture")
        body += chart + _caption("What the router's balance and z losses add to the objective, with their "
                                 "coefficients, per sequence and summed over the MoE layers (moe_router_loss); "
                                 "the training loss above does not include it." + said)
    return "loss", "Loss", body


def optimizer_section(run: dict) -> tuple[str, str, str]:
    steps, t = run["steps"], ((run["config"] or {}).get("train") or {})
    series = {"grad norm": _curve(steps, "grad_norm")}
    clip = _number(t.get("grad_clip"))
    if steps and math.isfinite(clip) and clip > 0:
        series[f"--grad-clip {clip:g}"] = [(steps[0]["step"], clip), (steps[-1]["step"], clip)]
    chart, said = _chart(series, "step", "global L2 norm", "gradient norm")
    body = chart + _caption("The global L2 norm of the gradient of the batch's mean loss, before clipping "
                            "(grad_norm); above --grad-clip the update is scaled down to it." + said)
    chart, said = _chart({"learning rate": _curve(steps, "lr")}, "step", "learning rate", "learning rate")
    body += chart + _caption("The learning rate of each step: linear warm-up over --warmup-steps, then a "
                             "cosine down to --min-lr at --steps (optim.cosine_lr)." + said)
    return "optimizer", "Gradient norm and learning rate", body


def speed_section(run: dict) -> tuple[str, str, str]:
    steps = run["steps"]
    chart, said = _chart({"tokens/s": _curve(steps, "tokens_per_s")}, "step", "tokens per second", "throughput")
    body = chart + _caption("Training tokens per second of the whole run (all ranks), over a sliding window of "
                            "the last 20 steps (tools/metrics.py:Throughput); the first step of a run or a "
                            "resume is not timed (no point)." + said)
    mfu = [(s, 100 * v) for s, v in _curve(steps, "mfu")]
    chart, said = _chart({"MFU": mfu}, "step", "MFU (%)", "model FLOPs utilisation")
    body += chart + _caption("Model FLOP/s (6 x active parameters + attention, per token, times tokens/s) over "
                             "the summed peak of every process: on the CPU the peak this run measured "
                             "(metrics.measure_cpu_peak), elsewhere the datasheet's. Recomputation is not "
                             "counted. No point where the rate or the peak is unknown." + said)
    return "speed", "Throughput and MFU", body


def memory_section(run: dict) -> tuple[str, str, str]:
    s, built = run["summary"], configs(run)
    if not s:
        return "memory", "Memory per rank", _caption("No summary.json yet: it is written when a run session ends.")
    kind = (run["config"] or {}).get("device_kind", "")
    peak = s.get("peak_memory")
    what = {"cuda": "the allocator's peak (torch.cuda.max_memory_allocated)",
            "cpu": "the process's peak resident set (ru_maxrss: Python, torch's libraries and every buffer, "
                   "not only tensors; no allocator peak is read on the CPU)"}.get(kind, "as the runtime reports it")
    rows, bars = [], []
    measured = [("weights", s.get("param_bytes")), ("gradient buffers", s.get("grad_bytes")),
                ("optimizer state", s.get("optimizer_bytes"))]
    if built:
        from nanohlat import plan
        model, train = built
        dp = (run["config"] or {}).get("dp") or 1
        eager = kind in ("cpu", "cuda")
        mem = plan.memory_per_rank(model, train, train.tp, train.pp, dp, 0, fused=eager, eager=eager)
        planned = [("weights", mem["weights"]), ("gradient buffers", mem["flat_grads"]),
                   ("optimizer state", mem["optimizer"])]
        for (name, m), (_, p) in zip(measured, planned):
            rows.append([name, f"{p:,}", "n/a" if m is None else f"{m:,}", "same" if m == p else "differs"])
        rows.append(["peak (plan: the above + fixed + max(forward/backward, optimizer step))", f"{mem['peak']:,}",
                     "n/a" if peak is None else f"{peak:,}",
                     f"measured / plan {peak / mem['peak']:.2f}" if kind == "cuda" and peak and mem["peak"]
                     else "not the same quantity (below)"])
        bars.append(("plan", planned + [("fixed buffers", mem["fixed"]),
                                        ("activations / step temporaries",
                                         max(mem["forward_backward"], mem["optimizer_step"]))]))
    else:
        rows = [[n, "n/a", "n/a" if m is None else f"{m:,}", ""] for n, m in measured]
    bars.append(("measured", [(n, m or 0) for n, m in measured]))
    limit = peak if kind == "cuda" and peak else None
    body = svg.stacked_bars(bars, "bytes on rank 0", limit=limit, limit_label="measured peak" if limit else "",
                            title="bytes per rank: plan against measured")
    body += _table(["term", "plan (bytes)", "measured (bytes)", ""], rows, [None, "plan", "measured", None])
    body += _caption(f"Rank 0 (pipeline stage 0). Measured: what the rank keeps between steps "
                     f"(summary.json, written when the run session that reached step {s.get('step')} ended: "
                     f"param_bytes, grad_bytes, optimizer_bytes, exact sizes of its buffers) and its "
                     f"peak, {what}: {fmt_bytes(peak) if peak else 'n/a'}. Plan: plan.memory_per_rank for this "
                     f"layout and device; its peak adds the fixed buffers and the larger of the activations kept "
                     f"for the backward and the optimizer step's temporaries."
                     + ("" if limit else " The dashed line of the allocator's peak is drawn on CUDA only."))
    return "memory", "Memory per rank", body


def comm_section(run: dict) -> tuple[str, str, str]:
    s, built = run["summary"], configs(run)
    if not s:
        return "comm", "Communication", _caption("No summary.json yet: it is written when a run session ends.")
    names = {"payload": "comm_bytes", "wire": "comm_wire_bytes", "padding": "comm_padding_bytes",
             "calls": "comm_calls"}
    measured = {k: {f: (s.get(n) or {}).get(k, 0) for f, n in names.items()} for k in (s.get("comm_bytes") or {})}
    if not measured:
        return "comm", "Communication", _caption("No collective in the first step: one process.")
    predicted, why = None, ""
    if built and not built[0].moe_experts:
        from nanohlat import plan
        from nanohlat.plan.params import mesh_at
        model, train = built
        dp = (run["config"] or {}).get("dp") or 1
        predicted = plan.comm_per_step(model, train, mesh_at(train.tp, train.pp, dp, 0, train.cp))
    elif built:
        why = " A mixture's all-to-all rows follow its routing: the ledger alone (--plan predicts balanced routing)."
    keys = sorted(set(measured) | set(predicted or {}))
    zero = dict.fromkeys(names, 0)
    bars, rows = [], []
    for k in keys:
        m, p = measured.get(k, zero), (predicted or {}).get(k)
        bars.append((k, [("ledger", m["payload"])] + ([("plan", p["payload"])] if p is not None else [])))
        rows.append([k, m["calls"], f"{m['payload']:,}", f"{m['wire']:,}", f"{m['padding']:,}",
                     "n/a" if p is None else f"{p['payload']:,}",
                     "" if p is None else "same" if p == m else "differs"])
    body = svg.grouped_bars(bars, "payload bytes per step on rank 0", title="comm ledger against the plan")
    body += _table(["collective", "calls", "payload", "wire", "padding", "plan payload", "plan (all four)"], rows)
    body += _caption(f"The first step's collectives on rank 0 as the comm ledger counted them (summary.json of "
                     f"the session that reached step {s.get('step')}), "
                     "per process group and kind: payload is what a collective delivers, wire what a ring "
                     "sends from the rank (2(n-1)/n x payload for an all-reduce, (n-1)/n for the rest), "
                     "padding the zeros an exchange sends for an idle direction; the plan's formula "
                     "(plan.comm_per_step) beside it, 'same' when all four figures agree." + why)
    return "comm", "Communication", body


def timeline_section(run: dict) -> tuple[str, str, str] | None:
    tl = run["timeline"]
    if not tl:
        return None
    try:
        kinds = {"F": 0, "B": 1, "W": 7}

        def rows(data, scale):
            return [(f"stage {s}", [(b * scale, e * scale, f"{k}{i}" + (f".{c}" if c else ""), kinds.get(k, 2))
                                    for k, i, b, e, c in ops]) for s, ops in enumerate(data)]
        bub = tl["bubble"]
        title = f"{tl['schedule']}: pp {tl['pp']}, m {tl['m']}" + (f", v {tl['v']}" if tl["v"] > 1 else "")
        body = svg.gantt(rows(tl["ideal"], 1.0), f"ideal time ({tl['units']})", title="ideal, " + title)
        body += svg.gantt(rows(tl["measured"], 1e3), "measured time in the last step (ms)", title="measured, " + title)
        body += _caption(f"Each stage's forwards (F) and backwards (B; zb-h1: B the input's gradient, W the "
                         f"weights') of micro-batch i (i.c: on chunk c). Ideal: no communication, {tl['units']}. "
                         f"Measured: the wall time of each op on each stage in the last step (timeline.json; "
                         f"on a CPU, processes also wait for a core). Bubble: ideal {bub['ideal']:.2f} = formula "
                         f"{bub['formula']} = {bub['formula_value']:.2f}; lock-step ticks {bub['lockstep']:.2f}; "
                         f"measured {bub['measured']:.2f} (idle + communication)."
                         + (f" {tl['warning']}" if tl.get("warning") else ""))
    except (KeyError, TypeError, ValueError) as e:
        body = _caption(f"timeline.json is not a timeline ({e!r}): left out.")
    return "timeline", "Pipeline timeline (--timeline)", body


def experts_section(run: dict) -> tuple[str, str, str] | None:
    steps = run["steps"]
    if not any("moe_load_max" in r for r in steps):
        return None
    chart, said = _chart({"busiest / mean (1: balanced)": _curve(steps, "moe_load_max"),
                          "std / mean (0: balanced)": _curve(steps, "moe_load_cv")},
                         "step", "tokens per expert, ratio", "experts' load")
    body = chart + _caption("Tokens routed to each expert in a step, summed over the global batch: the busiest "
                            "expert's over the mean expert's, the largest over the MoE layers (moe_load_max; "
                            "1 when balanced), and the standard deviation over the mean, averaged over the "
                            "layers (moe_load_cv; 0 when balanced)." + said)
    dropped = _curve(steps, "moe_dropped")
    if any(v for _, v in dropped):
        chart, said = _chart({"dropped": [(s, 100 * v) for s, v in dropped]}, "step", "choices dropped (%)",
                             "routing choices over capacity")
        body += chart + _caption("The share of routing choices dropped by an expert's capacity, mean over "
                                 "the layers (moe_dropped)." + said)
    return "experts", "Experts' load (mixture of experts)", body


def health_section(run: dict) -> tuple[str, str, str]:
    steps = run["steps"]
    every = ((run["config"] or {}).get("train") or {}).get("log_every", 1)
    bad = [[r["step"], _fmt(r.get("loss")), _fmt(r.get("grad_norm"))] for r in steps
           if not (math.isfinite(_number(r.get("loss"))) and math.isfinite(_number(r.get("grad_norm"))))]
    body = (_table(["step", "loss", "grad norm"], bad) if bad
            else f'<p data-report="non-finite">none of the {len(steps):,} logged steps</p>')
    body += _caption("Logged steps whose loss or gradient norm was not finite: the optimizer skipped their "
                     "update (optim.FlatAdamW.update), and --max-bad-steps in a row stop the run at the last "
                     "good step."
                     + (f" With --log-every {every}, a skipped step between two logged ones is not listed here "
                        f"(the run's warning on stderr counts it)." if every != 1 else ""))
    restarts = [[r.get("restart"), r.get("failed_after_step"), r["step"], r.get("steps_recomputed")]
                for r in run.get("restarts", [])]
    if restarts:
        body += "<h3>restarts</h3>" + _table(["restart", "failed after step", "resumed from step",
                                              "steps computed again"], restarts)
        body += _caption("Each time --max-restarts started the job again after a failure (metrics.jsonl's "
                         "restart rows, run/restarts.py): the steps after the checkpoint it resumed from were "
                         "trained again.")
    rows = [[s, "?" if tok is None else f"{tok:,}", name] for s, tok, name in run.get("checkpoints", [])]
    body += "<h3>checkpoints</h3>" + (_table(["step", "tokens seen", "folder (checkpoints/)"], rows) if rows
                                      else "<p>none saved yet</p>")
    return "health", "Skipped steps, restarts and checkpoints", body


def eval_section(run: dict) -> tuple[str, str, str] | None:
    ev = run["eval"]
    results = ev.get("results") if ev else None
    if not isinstance(results, list) or not results:
        return None
    try:
        tasks = list(results[0].get("tasks", {}))
        header = ["step", "tokens", "val_loss", "perplexity", "bits/byte"] + [f"{t} acc" for t in tasks]
        rows = [[r["step"], f"{r['tokens']:,}", _fmt(r["val_loss"]), _fmt(r["perplexity"], 2),
                 _fmt(r["bits_per_byte"])] + [_fmt(r["tasks"][t]["acc"], 3) for t in tasks] for r in results]
        body = _table(header, rows)
        if len(results) > 1:
            body += svg.line_chart({"val_loss": [(r["tokens"], _number(r["val_loss"])) for r in results]},
                                   "tokens seen", "held-out loss (nats per token)", title="eval.py per checkpoint")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return "eval", "eval.py", _caption(f"eval.json is not eval.py's ({e!r}): left out.")
    return "eval", "eval.py (eval.json)", body + _caption(
        "eval.py's table (eval.py --all-checkpoints: one row per checkpoint): the held-out loss over the "
        "validation split in windows of the run's seq_len, its perplexity, bits per byte of text, and each "
        "task's accuracy (chance is 1 over the number of choices).")


SECTIONS = (overview, loss_section, optimizer_section, speed_section, memory_section, comm_section,
            timeline_section, experts_section, health_section, eval_section)


def sections(run: dict) -> list[tuple[str, str, str]]:
    """The page's sections; one that cannot be drawn from what its files hold (a value of
    another type in a hand-edited summary.json, ...) says so in its place, the others are drawn."""
    out = []
    for f in SECTIONS:
        try:
            got = f(run)
        except Exception as e:   # noqa: BLE001 (one section's figures are not worth the page)
            if cli.not_done(e) is not None:   # an exercise stub (student copy): its one line, cli.py
                raise
            name = f.__name__.replace("_section", "")
            got = (name, f"{name} (not drawn)",
                   _caption(f"this section could not be drawn from the run's files ({type(e).__name__}: {e})"))
        if got is not None:
            out.append(got)
    return out


# ---------------------------------------------------------------------------
# Pages
# ---------------------------------------------------------------------------

STYLE = ("body{font-family:sans-serif;margin:1.5em;max-width:1300px;color:#222}"
         "h2{border-bottom:1px solid #ccc;margin-top:1.6em}table{border-collapse:collapse;margin:.5em 0}"
         "td,th{border:1px solid #ccc;padding:2px 8px;text-align:left;font-size:13px}"
         ".caption{font-size:13px;color:#444;max-width:70em}.note{color:#a00}"
         ".pair{display:grid;grid-template-columns:1fr 1fr;gap:1.5em}.pair>div{min-width:0;overflow-x:auto}")


def page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f"<style>{STYLE}</style></head><body><h1>{escape(title)}</h1>{body}</body></html>\n")


def run_page(out_dir: str) -> str:
    """report.html of the run in `out_dir`."""
    run = read_run(out_dir)
    body = "".join(f'<section id="{i}"><h2>{escape(t)}</h2>{b}</section>' for i, t, b in sections(run))
    return page(f"nanohlat run report: {out_dir}", body)


def compare_page(a: str, b: str) -> str:
    """The runs in folders `a` and `b` side by side: their losses on one chart, then each
    section of their reports in two columns (A left, B right)."""
    runs = [read_run(a), read_run(b)]
    both = {f"{n} loss": _curve(r["steps"], "loss") for n, r in zip("AB", runs)}
    chart, said = _chart(both, "step", "training loss (nats per token)", "training loss, A and B")
    body = (f'<p>A: <span data-report="run-a">{escape(a)}</span><br>B: <span data-report="run-b">{escape(b)}'
            f"</span></p>{chart}" + _caption("Both runs' training loss per step (metrics.jsonl)." + said))
    secs = [{i: (t, h) for i, t, h in sections(r)} for r in runs]
    for i in dict.fromkeys([i for s in secs for i in s]):
        title = (secs[0].get(i) or secs[1].get(i))[0]
        cols = "".join(f'<div class="run-{n}"><h3>{n}</h3>{s[i][1] if i in s else "<p>not in this run</p>"}</div>'
                       for n, s in zip("AB", secs))
        body += f'<section id="{i}"><h2>{escape(title)}</h2><div class="pair">{cols}</div></section>'
    return page("nanohlat: two runs compared", body)


def write(out_dir: str) -> str:
    """Draw and write `out_dir`/report.html (files.write_text: atomic, never through a link). Returns its path."""
    path = os.path.join(out_dir, REPORT)
    files.write_text(path, run_page(out_dir))
    return path


_warned: set = set()


def write_quietly(out_dir: str) -> str | None:
    """write(), but a page that cannot be drawn or written (a full disk, a bug here) costs no
    step: one warning on stderr (once per out-dir and reason), and the run goes on. (An
    exercise stub it reaches in a student copy still ends the command with its one line:
    no wrapper catches a stub, classroom/needs.py.) Its records
    (metrics.jsonl, summary.json, the checkpoints) are what the page is drawn from, and the next
    evaluation or the end of the run writes it again. Returns the path, or None."""
    try:
        return write(out_dir)
    except Exception as e:   # noqa: BLE001 (deliberately anything: the page is never worth a step)
        if cli.not_done(e) is not None:   # but an exercise stub of a student copy: its one line (cli.py)
            raise
        why = f"{type(e).__name__}: {e}"
        if (out_dir, why) not in _warned:
            _warned.add((out_dir, why))
            print(f"warning: {os.path.join(out_dir, REPORT)} not written ({why}); training goes on, "
                  f"its records (metrics.jsonl, the checkpoints) are intact", file=sys.stderr)
        return None
