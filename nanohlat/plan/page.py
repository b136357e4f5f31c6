"""`train.py --plan --html FILE`: the planner as one self-contained page (no network: its style, data and
script are inside it), held to measured bytes.

    a control per layout flag      a form element named as the flag without its dashes (--tp: tp,
                                   --virtual-stages: virtualstages, --sequence-parallel: sequenceparallel)
    the chosen layout              its bytes per rank term by term (the memory table of --plan, and a stacked
                                   bar of the peak's parts against the device's memory), each collective's
                                   bytes per step, the bubble, the step time and MFU, whether it fits
    the ranking of --search        a table one sorts by clicking a column; a row sets the controls
    the plan against measurement   the layout matrix's runs the repository ships (plan/measured.py) and the
                                   run folders of --measured: each term planned, measured, and how far apart

Every figure is an element whose `data-plan` attribute names it (`peak-bytes`, `fits`, `step-time-s`,
`bubble`, `mfu`, `memory-<column>`, `comm-<collective>`, ...) and whose text is what --plan prints.
One source of truth: Python computes every number (plan/page_data.py, by the functions that print
--plan); the script below only looks a layout up by its controls' values and draws what it finds.
A combination the page does not hold says so, and how to see it, never an older layout's numbers.
"""

from __future__ import annotations

import html
import json
import re
import shlex

from nanohlat.recipe import ModelConfig, TrainConfig
from nanohlat.plan import measured as measuredlib
from nanohlat.plan.fmt import fmt_count
from nanohlat.plan.page_data import CONTROLS, control_value, page_data
from nanohlat.plan.sheets import schedule_text
from nanohlat.system import files


def slug(text: str) -> str:
    """A column's or a term's name as a data-plan suffix: 'Adam ZeRO-1' -> 'adam-zero-1'."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def flag_of(name: str) -> str:
    """The flag a control sets: tp -> --tp, virtualstages -> --virtual-stages."""
    return "--" + CONTROLS[name].replace("_", "-")


def error_text(error) -> str:
    """How far the plan was from a measurement: 'same', '+3.1%', or '-' where nothing was measured."""
    return "-" if error is None else "same" if error == 0 else f"{error:+.1%}"


def measured_section(title: str, runs: dict[str, tuple[dict, dict]], prefix: str) -> str:
    """The plan against what `runs` ({name: (config.json, summary.json)}) measured: per term, over all
    runs, how many matched exactly and the largest error; then each run's rows (static HTML)."""
    by_term, details = {}, []
    for name, (config, summary) in runs.items():
        rows = measuredlib.compare(config, summary)
        cells = "".join(
            f"<tr><td>{html.escape(r['term'])}</td><td>{r['planned']:,}</td>"
            f"<td>{'-' if r['measured'] is None else format(r['measured'], ',')}</td>"
            f"<td data-plan=\"{prefix}-{slug(name)}-{slug(r['term'])}\">{error_text(r['error'])}</td></tr>"
            for r in rows)
        flags = html.escape(config["train"].get("preset", "") + f", {config['world']} rank(s)")
        details.append(f"<details><summary>{html.escape(name)} ({flags})</summary><table><tr><th>term</th>"
                       f"<th>planned</th><th>measured</th><th>plan / measured - 1</th></tr>{cells}</table></details>")
        for r in rows:
            kind = r["term"].split(" ")[-1] if r["term"].split(" ")[-1] in measuredlib.COMM_FIGURES else r["term"]
            by_term.setdefault(kind, []).append(r["error"])
    summary = []
    for term, errors in by_term.items():
        known = [e for e in errors if e is not None]
        worst = max(known, key=abs) if known else None
        summary.append(f"<tr><td>{html.escape(term)}</td><td>{len(known)}</td>"
                       f"<td>{sum(1 for e in known if e == 0)}</td>"
                       f"<td data-plan=\"{prefix}-error-{slug(term)}\">{error_text(worst)}</td></tr>")
    return (f"<h3>{html.escape(title)}</h3><table class=\"errors\"><tr><th>term</th><th>measured in</th>"
            f"<th>exact</th><th>largest plan / measured - 1</th></tr>{''.join(summary)}</table>{''.join(details)}")


def build(cfg: ModelConfig, tcfg: TrainConfig, world: int, argv: list[str], runs: dict) -> str:
    """The page's HTML for this command line (`argv`) and the run folders read from --measured."""
    data = page_data(cfg, tcfg, world)
    data["flags"] = {name: flag_of(name) for name in CONTROLS}
    data["base"] = base_command(argv)
    shipped = measuredlib.shipped()
    matrix = {name: (r["config"], r["summary"]) for name, r in shipped["runs"].items()}
    own = dict(zip(CONTROLS, data["own"].split("|")))   # (the command's values, dp resolved)
    options = "".join(control_html(name, data["options"][name], own[name]) for name in CONTROLS)
    hardware = "".join(f"<option value=\"{html.escape(d)}\">{html.escape(d)}</option>" for d in data["devices"])
    blob = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    title = (f"plan for preset {tcfg.preset}: {fmt_count(cfg.num_params())} parameters, {world} ranks")
    held = (f"{len(data['layouts']):,} layouts: every tp, pp (and cp, ep) the world and the model allow, dp = the "
            f"rest, ZeRO 0-3, every schedule, every number of micro-batches; the other flags as given "
            f"(precision {tcfg.precision}, moments {tcfg.moments}, checkpointing {tcfg.activation_checkpointing}, "
            f"sequence parallel {control_value(tcfg.sequence_parallel)}, --device {tcfg.device}, "
            f"--seq-len {tcfg.seq_len}); it opens on the command's own layout (schedule {schedule_text(tcfg)})")
    return PAGE.format(
        title=html.escape(title), command=html.escape(" ".join(["python train.py"] + argv)),
        held=html.escape(held), controls=options, hardware=hardware, data=blob,
        matrix=measured_section(f"the layout matrix's runs (shipped: {shipped['command']})", matrix, "matrix"),
        given=measured_section("the runs given with --measured", runs, "given") if runs else
        "<p>(no run folders given: add <code>--measured DIR...</code> to set your runs beside the plan)</p>",
        script=SCRIPT, style=STYLE)


def control_html(name: str, values: list[str], own: str) -> str:
    values = values if own in values else values + [own]
    opts = "".join(f"<option value=\"{html.escape(v)}\"{' selected' if v == own else ''}>{html.escape(v)}</option>"
                   for v in values)
    return f"<label>{flag_of(name)} <select name=\"{name}\">{opts}</select></label>"


def base_command(argv: list[str]) -> str:
    """The command line less the controls' flags and the page's own (--plan, --search, --html, --measured):
    the page appends the controls' values and --plan to it for a combination it does not hold."""
    switches = {"--plan", "--search", "--zero1", "--no-zero1"} | {
        f for name, field in CONTROLS.items() if isinstance(getattr(TrainConfig, field), bool)
        for f in (flag_of(name), "--no-" + flag_of(name)[2:])}
    valued = {flag_of(name) for name, field in CONTROLS.items()
              if not isinstance(getattr(TrainConfig, field), bool)} | {"--html"}
    kept, skip, many = [], 0, False
    for arg in argv:
        name = arg.split("=", 1)[0]
        if many and not arg.startswith("--"):
            continue
        many = False
        if skip:
            skip -= 1
        elif name in switches:
            pass
        elif name in valued:
            skip = 0 if "=" in arg else 1
        elif name == "--measured":
            many = "=" not in arg
        else:
            kept.append(arg)
    return shlex.join(["python", "train.py"] + kept)


def write(cfg: ModelConfig, tcfg: TrainConfig, world: int, argv: list[str]) -> None:
    """Read --measured's run folders, build the page, write --html through the atomic writer."""
    runs = {folder: measuredlib.read_run(folder) for folder in tcfg.measured}
    text = build(cfg, tcfg, world, argv, runs)
    files.write_text(tcfg.html, text)


STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;max-width:1200px;color:#222}
h1{font-size:1.3em}h2{font-size:1.1em;margin-top:1.6em}h3{font-size:1em}
form label{display:inline-block;margin:0 1em .4em 0}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}
td:first-child,th:first-child{text-align:left}th{background:#f3f3f3}
#missing{background:#fff3cd;border:1px solid #e0c060;padding:.6em}
.fits{color:#060;font-weight:bold}.nofit{color:#a00;font-weight:bold}
#search th{cursor:pointer}#search tr.row:hover{background:#eef}#search-wrap{max-height:30em;overflow:auto}
code{background:#f3f3f3;padding:0 3px}
"""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title><style>{style}</style></head>
<body>
<h1>{title}</h1>
<p>Written by <code>{command}</code>. Every number is nanohlat's planner's (nanohlat/plan/), as
<code>--plan</code> prints it for the layout chosen; the page draws, it computes nothing. It holds {held}.
Any other combination says so below: run the command it gives to see it.</p>
<form id="controls">{controls}<label>device of the time and memory figures <select name="hardware">{hardware}
</select></label></form>
<div id="missing" data-plan="missing" hidden></div>
<section id="layout">
<h2>memory per rank: the largest stage (<span data-plan="largest-stage"></span>)</h2>
<svg id="bar" width="900" height="100" role="img" aria-label="bytes per rank, stacked, against the device's memory"></svg>
<p>peak <b data-plan="peak-bytes"></b> per rank:
<span data-plan="fits"></span> (<span data-plan="fits-detail"></span>)</p>
<table id="memory"></table>
<h2>time per step</h2>
<p>step <b data-plan="step-time-s"></b>, bubble <b data-plan="bubble"></b>, MFU <b data-plan="mfu"></b></p>
<table id="time"></table>
<h2>bytes each collective moves per step</h2>
<div id="comm"></div>
</section>
<h2>the layouts that fit, ranked (--search)</h2>
<p>Click a column to sort by it, a row to choose its layout above.</p>
<div id="search-wrap"><table id="search"></table></div>
<h2>the plan against measurement</h2>
<p>Each term the runs measured on rank 0 (summary.json: weights, fp32 gradient buffers, Adam's state, the
micro-batches in flight, each collective's payload, wire bytes and calls in the comm ledger) beside the
plan for the same configuration; the peak only where it is the allocator's (cuda: on the cpu a run records
the process's resident set, which holds Python and torch too, not the plan's peak).</p>
{matrix}
{given}
<script type="application/json" id="plan-data">{data}</script>
<script>{script}</script>
</body></html>
"""

SCRIPT = r"""
"use strict";
const D = JSON.parse(document.getElementById("plan-data").textContent), S = D.strings;
const form = document.getElementById("controls");
const $ = (sel) => document.querySelector(sel);
function cell(tag, text, name) {
  const c = document.createElement(tag); c.textContent = text; if (name) c.dataset.plan = name; return c;
}
function slug(t) { return t.toLowerCase().replace(/[^a-z0-9.]+/g, "-").replace(/^-+|-+$/g, ""); }
function row(cells, tag, names) {
  const r = document.createElement("tr");
  cells.forEach((t, i) => r.appendChild(cell(tag, t, names ? names[i] : null)));
  return r;
}
function setText(name, text) { document.querySelectorAll(`[data-plan="${name}"]`).forEach(e => e.textContent = text); }
function clear() {
  ["largest-stage", "peak-bytes", "fits", "fits-detail", "step-time-s", "bubble", "mfu"].forEach(n => setText(n, ""));
  ["#memory", "#time", "#comm", "#bar"].forEach(s => $(s).replaceChildren());
}
function command() {
  const parts = [D.base];
  D.controls.forEach(n => {
    const v = form.elements[n].value;
    if (v === "on") parts.push(D.flags[n]);
    else if (v === "off") parts.push("--no-" + D.flags[n].slice(2));
    else parts.push(D.flags[n] + " " + v);
  });
  return parts.join(" ") + " --plan";
}
function render() {
  const key = D.controls.map(n => form.elements[n].value).join("|");
  const r = D.layouts[key], missing = $("#missing");
  clear();
  if (!r) {
    const f = ["tp", "pp", "dp", "cp"].map(n => form.elements[n].value).join("|");
    missing.textContent = "This page holds no plan for these values (a layout --plan refuses, or one outside the set " +
      "the page holds: see the top of the page). " + (D.notes[f] ? D.notes[f] + " " : "") +
      "To see it, or why it is refused: " + command();
    missing.hidden = false;
    return;
  }
  missing.hidden = true;
  const hw = form.elements.hardware.value;
  setText("largest-stage", String(r.largest));
  setText("peak-bytes", S[r.peak]);
  const fit = r.fits[hw];
  setText("fits", fit ? S[fit[0]] : "fits");
  setText("fits-detail", fit ? S[fit[1]] : "no memory figure for " + hw + ": --search counts it as fitting");
  $('[data-plan="fits"]').className = fit && S[fit[0]] !== "fits" ? "nofit" : "fits";
  const mem = $("#memory");
  mem.appendChild(row(r.memory.map(p => S[p[0]]), "th"));
  mem.appendChild(row(r.memory.map(p => S[p[1]]), "td", r.memory.map(p => "memory-" + slug(S[p[0]]))));
  const head = r.time_header.map(i => S[i]), cells = r.time[hw].map(i => S[i]);
  $("#time").appendChild(row(head, "th"));
  $("#time").appendChild(row(cells, "td", head.map(h => "time-" + slug(h))));
  setText("step-time-s", cells[head.indexOf("step")]);
  setText("bubble", cells[head.indexOf("bubble")]);
  setText("mfu", cells[head.indexOf("MFU")]);
  r.comm.forEach(([label, entries], i) => {
    const pre = i === 0 ? "comm-" : "comm-last-";
    $("#comm").appendChild(cell("h3", S[label]));
    const t = document.createElement("table");
    t.appendChild(row(["collective", "calls", "payload", "wire", "padding"], "th"));
    if (!entries.length) t.appendChild(row(["none: one process", "", "", "", ""], "td"));
    entries.forEach(e => {
      const k = S[e[0]];
      t.appendChild(row(e.map(i => S[i]), "td", [null, pre + k + "-calls", pre + k, pre + k + "-wire", pre + k + "-padding"]));
    });
    $("#comm").appendChild(t);
  });
  drawBar(r, ...D.devices[hw]);
}
const COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#9c755f", "#e15759", "#edc948", "#b07aa1"];
function drawBar(r, cap, capText) {
  const svg = $("#bar"), ns = "http://www.w3.org/2000/svg", width = 880;
  const total = r.bar.reduce((a, b) => a + b[1], 0), scale = width / Math.max(total, cap || 0, 1);
  let x = 10;
  r.bar.forEach(([name, bytes, text], i) => {
    const rect = document.createElementNS(ns, "rect");
    Object.entries({x: x, y: 12, width: Math.max(bytes * scale, 0), height: 30, fill: COLOURS[i % COLOURS.length]})
      .forEach(([k, v]) => rect.setAttribute(k, v));
    const title = document.createElementNS(ns, "title"); title.textContent = S[name] + ": " + S[text];
    rect.appendChild(title); svg.appendChild(rect);
    const label = document.createElementNS(ns, "text");
    label.setAttribute("x", 10 + (i % 3) * 290); label.setAttribute("y", 62 + 14 * Math.floor(i / 3));
    label.setAttribute("font-size", "11"); label.setAttribute("fill", COLOURS[i % COLOURS.length]);
    label.textContent = "\u25a0 " + S[name] + " " + S[text]; label.dataset.plan = "bar-" + slug(S[name]);
    svg.appendChild(label);
    x += bytes * scale;
  });
  if (cap) {
    const line = document.createElementNS(ns, "line");
    Object.entries({x1: 10 + cap * scale, x2: 10 + cap * scale, y1: 10, y2: 46, stroke: "#000", "stroke-width": 2})
      .forEach(([k, v]) => line.setAttribute(k, v));
    const t = document.createElementNS(ns, "title"); t.textContent = "the device's memory"; line.appendChild(t);
    svg.appendChild(line);
    const label = document.createElementNS(ns, "text");
    label.setAttribute("x", Math.min(14 + cap * scale, width - 150)); label.setAttribute("y", 8);
    label.setAttribute("font-size", "10"); label.textContent = "one device: " + capText;
    svg.appendChild(label);
  }
}
function choose(key) {
  key.split("|").forEach((v, i) => {
    const el = form.elements[D.controls[i]];
    if (![...el.options].some(o => o.value === v)) el.appendChild(new Option(v, v));
    el.value = v;
  });
  render();
  window.scrollTo(0, 0);
}
let order = {col: 0, up: true};
function drawSearch() {
  const t = $("#search"), rows = D.search.rows.slice();
  const {col, up} = order;
  rows.sort((a, b) => {
    const x = a[1][col] ?? S[a[0][col]], y = b[1][col] ?? S[b[0][col]];
    return (x < y ? -1 : x > y ? 1 : 0) * (up ? 1 : -1);
  });
  t.replaceChildren();
  const head = row(D.search.header.map(i => S[i] + (i === D.search.header[col] ? (up ? " \u25b2" : " \u25bc") : "")), "th");
  [...head.children].forEach((th, i) => th.onclick = () => { order = {col: i, up: order.col === i ? !order.up : true}; drawSearch(); });
  t.appendChild(head);
  rows.forEach(([cells, , key]) => {
    const r = row(cells.map(i => S[i]), "td");
    r.className = "row"; r.onclick = () => choose(key); t.appendChild(r);
  });
}
form.addEventListener("change", render);
render();
drawSearch();
"""
