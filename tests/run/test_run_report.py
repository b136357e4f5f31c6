"""A run's report.html (run/report.py, issue 60): written at each evaluation and at the end,
self-contained, opened in headless Chromium with no console error, showing the run's own
numbers as its files hold them (the final loss to four decimals, the step count, a pp 2
run's timeline, a mixture's experts' load); written like every run file (never through a
link; a FIFO there is refused before any work: tests/run/test_no_write_through_links.py),
and a page that cannot be drawn costs no step."""

from __future__ import annotations

import json
import math
import os
import re
import sys

import pytest

from browser import browser, open_page

TINY = ["--preset", "tiny", "--no-progress"]


def last_loss(out) -> tuple[int, float]:
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in line]
    return rows[-1]["step"], rows[-1]["loss"]


@pytest.fixture(scope="module")
def chromium():
    driver = browser()
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def tiny_run(cache_dir, tmp_path_factory):
    """`train.py --preset tiny --steps 20` (evaluating at steps 10 and 20), with every report
    write it made recorded: (out-dir, the steps metrics.jsonl held at each write)."""
    import train
    from nanohlat.run import trainlog
    out = str(tmp_path_factory.mktemp("report") / "tiny")
    writes, real = [], trainlog.write_report

    def recorded(out_dir):
        writes.append(len(open(os.path.join(out_dir, "metrics.jsonl")).read().splitlines()))
        return real(out_dir)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainlog, "write_report", recorded)
        assert train.main(TINY + ["--steps", "20", "--cache-dir", cache_dir, "--out-dir", out]) == 0
    return out, writes


@pytest.mark.slow
def test_a_run_writes_its_report_at_each_evaluation_and_at_the_end(tiny_run, chromium, tmp_path):
    out, writes = tiny_run
    # steps 1-10 and the eval row; 1-20 and two eval rows (the last eval); the end of the run
    assert writes == [11, 22, 22]
    page = open_page(chromium, os.path.join(out, "report.html"))
    assert page.errors() == []
    step, loss = last_loss(out)
    assert page.find('[data-report="final-loss"]').text == f"{loss:.4f}"
    assert page.find('[data-report="steps"]').text == f"{step} (of 20)" == "20 (of 20)"
    val = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if "val_loss" in line][-1]
    assert page.find('[data-report="final-val-loss"]').text == f"{val['val_loss']:.4f} (step 20)"
    for section in ("loss", "optimizer", "speed", "memory", "comm", "health"):
        assert page.find(f"section#{section} h2").text, section
    # the plan's bytes against summary.json's, to the byte (tests/plan/plan_utils.py holds them equal)
    summary = json.load(open(os.path.join(out, "summary.json")))
    cells = [(p.text, m.text) for p, m in zip(page.find_all('[data-report="plan"]'),
                                              page.find_all('[data-report="measured"]'))]
    assert cells[:3] == [(f"{summary[k]:,}",) * 2 for k in ("param_bytes", "grad_bytes", "optimizer_bytes")]
    assert page.find('[data-report="non-finite"]').text == "none of the 20 logged steps"
    assert "step_00000020" in page.find("section#health").text
    page.screenshot(str(tmp_path / "report.png"))
    assert os.path.getsize(tmp_path / "report.png") > 10_000
    # self-contained: nothing it loads (no src, no link, no script, no url())
    text = open(os.path.join(out, "report.html"), encoding="utf-8").read()
    assert not re.search(r"<script|<link|<img|<iframe|\bsrc=|url\(|@import", text)


@pytest.mark.slow
def test_the_report_of_a_pp2_run_with_timeline_shows_its_timeline(cache_dir, chromium, tmp_path):
    import train
    out = tmp_path / "pp2"
    assert train.main(TINY + ["--steps", "2", "--eval-every", "0", "--nproc", "2", "--pp", "2", "--microbatches", "2",
                              "--timeline", "--threads", "1", "--cache-dir", cache_dir, "--out-dir", str(out)]) == 0
    tl = json.load(open(out / "timeline.json"))
    page = open_page(chromium, str(out / "report.html"))
    assert page.errors() == []
    section = page.find("section#timeline")
    charts = section.find_elements("css selector", "svg")
    assert len(charts) == 2   # the ideal timeline and the measured one
    for chart, rows in zip(charts, (tl["ideal"], tl["measured"])):
        boxes = chart.find_elements("css selector", "rect title")   # one box per op, titled F0, B1, ...
        names = sorted(b.get_attribute("textContent") for b in boxes)
        assert names == sorted(f"{k}{i}" for ops in rows for k, i, *_ in ops) == ["B0", "B0", "B1", "B1",
                                                                               "F0", "F0", "F1", "F1"]
    caption = section.text
    assert f"measured {tl['bubble']['measured']:.2f}" in caption and "(p-1)/(m+p-1) = 0.33" in caption
    # the ledger against the plan: the same, collective by collective
    comm = page.find("section#comm table").text.splitlines()
    assert [line.split()[0] for line in comm[1:]] == ["pp.all_reduce", "pp.exchange"]
    assert all(line.endswith(" same") for line in comm[1:]), comm
    page.screenshot(str(tmp_path / "report_pp2.png"))


@pytest.mark.slow
def test_the_report_of_a_mixture_shows_the_experts_load_and_router_losses(cache_dir, chromium, tmp_path):
    import train
    out = tmp_path / "moe"
    assert train.main(["--preset", "moe", "--steps", "2", "--eval-every", "0", "--no-progress", "--cache-dir",
                       cache_dir, "--out-dir", str(out)]) == 0
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    page = open_page(chromium, str(out / "report.html"))
    assert page.errors() == []
    experts = page.find("section#experts")
    assert "Experts' load" in experts.text and "moe_load_max" in experts.text
    # one curve each for the busiest expert's load and the spread, through the logged points
    assert len(experts.find_elements("css selector", "svg polyline")) == 2
    assert "router losses" in page.find("section#loss").text
    assert page.find('[data-report="final-loss"]').text == f"{rows[-1]['loss']:.4f}"
    page.screenshot(str(tmp_path / "report_moe.png"))


@pytest.mark.slow
def test_report_html_at_a_link_is_replaced_and_a_failed_page_costs_no_step(cache_dir, tmp_path, capsys, monkeypatch):
    """A link at report.html (and a dangling one at its .partial) is replaced by the page, its target
    untouched; with matplotlib gone the run still writes it; a page that cannot be drawn is one
    warning and the run trains on, exit 0, its records whole."""
    import train
    from nanohlat.run import report
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # as where it is not installed
    out = tmp_path / "run"
    out.mkdir()
    victim = tmp_path / "victim.html"
    victim.write_text("mine")
    os.symlink(victim, out / "report.html")
    os.symlink(tmp_path / "created", out / "report.html.partial")
    assert train.main(TINY + ["--steps", "2", "--eval-every", "1", "--cache-dir", cache_dir,
                              "--out-dir", str(out)]) == 0
    assert victim.read_text() == "mine" and not os.path.lexists(tmp_path / "created")
    assert not os.path.islink(out / "report.html") and "nanohlat run report" in (out / "report.html").read_text()
    assert not os.path.lexists(out / "report.html.partial")

    def broken(out_dir):
        raise ValueError("a bug in the page")
    monkeypatch.setattr(report, "run_page", broken)
    again = tmp_path / "again"
    capsys.readouterr()
    assert train.main(TINY + ["--steps", "3", "--eval-every", "1", "--cache-dir", cache_dir, "--out-dir",
                              str(again)]) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "report.html not written" in line]
    assert warnings == [f"warning: {again / 'report.html'} not written (ValueError: a bug in the page); training goes "
                        f"on, its records (metrics.jsonl, the checkpoints) are intact"]   # once, not at each eval
    assert last_loss(again)[0] == 3 and not os.path.exists(again / "report.html")


# ---------------------------------------------------------------------------
# Drawn from the files alone (no training)
# ---------------------------------------------------------------------------

def fake_run(folder, rows, vals=(), summary=None, extra_lines=(), kind="cpu"):
    """A run folder: tiny's config.json (run on `kind`), `rows` as metrics.jsonl (and `vals`), maybe a summary.json."""
    from nanohlat import recipe
    from nanohlat.system import files
    os.makedirs(folder)
    model, train = recipe.parse_args(TINY)
    files.write_text(os.path.join(folder, "config.json"),
                     files.json_text(recipe.to_dict(model, train) | {"world": 1, "dp": 1, "device_kind": kind}))
    lines = [files.json_text(r) for r in rows] + [files.json_text(v) for v in vals] + list(extra_lines)
    files.write_text(os.path.join(folder, "metrics.jsonl"), "\n".join(lines) + "\n")
    if summary is not None:
        files.write_text(os.path.join(folder, "summary.json"), summary)
    return str(folder)


def test_the_page_lists_non_finite_steps_and_reads_around_damage(tmp_path):
    """A logged NaN step is listed (and leaves a gap in the curve), a restart too; a damaged metrics
    line and an unreadable summary.json are named in a note, and the rest is drawn; eval.json adds
    its table."""
    from nanohlat.run import report
    rows = [{"step": s, "loss": 6.0 - s / 10, "lr": 1e-3, "grad_norm": 1.0, "tokens": 256 * s,
             "tokens_per_s": None, "mfu": None} for s in range(1, 6)]
    rows[2] |= {"loss": math.nan, "grad_norm": math.inf}
    out = fake_run(tmp_path / "r", rows, vals=[{"step": 5, "val_loss": 5.55555}], summary="{not json",
                   extra_lines=['{"step": 6, "loss": 1.0', '{"step": 2, "restart": 1, "failed_after_step": 4, '
                                '"steps_recomputed": 2}'])
    from nanohlat.system import files
    files.write_text(os.path.join(out, "eval.json"), files.json_text({"results": [
        {"step": 5, "tokens": 1280, "val_loss": 5.25, "perplexity": 190.6, "bits_per_byte": 3.9,
         "tasks": {"builtin": {"acc": 0.375}}}]}))
    text = report.run_page(out)
    assert "<tr><td>3</td><td>NaN</td><td>Infinity</td></tr>" in text
    assert "<tr><td>1</td><td>4</td><td>2</td><td>2</td></tr>" in text   # the restart: after step 4, from 2
    assert "metrics.jsonl has 1 damaged line(s), left out" in text
    assert "summary.json is unreadable" in text and "No summary.json yet" in text
    assert 'data-report="final-loss">5.5000<' in text and 'data-report="final-val-loss">5.5556 (step 5)<' in text
    assert "<td>1,280</td><td>5.2500</td><td>190.60</td><td>3.9000</td><td>0.375</td>" in text
    # the curve breaks at the NaN: steps 1-2 and 4-5 are two polylines of the loss chart
    loss_svg = text.split('id="loss"')[1].split("</svg>")[0]
    assert loss_svg.count("<polyline") == 2


def test_a_long_run_draws_at_most_max_points_and_always_its_last_step():
    from nanohlat.run import report
    pts = [(s, float(s)) for s in range(1, 2502)]
    thin, k = report._thin(pts)
    assert k == 3 and len(thin) <= report.MAX_POINTS + 1 and thin[-1] == (2501, 2501.0) and thin[0] == (1, 1.0)
    assert report._thin(pts[:1000]) == (pts[:1000], 1)


def test_a_section_its_files_cannot_draw_says_so_and_a_stub_is_never_caught(tmp_path, monkeypatch):
    """A summary.json whose comm figures are no record (hand-edited) costs the comm section only;
    an exercise stub reached while drawing (a student copy) ends the command with its own line,
    as every stub does (classroom/needs.py: no wrapper catches one)."""
    from nanohlat.classroom import kit as classroom
    from nanohlat.run import report
    rows = [{"step": 1, "loss": 6.0, "lr": 1e-3, "grad_norm": 1.0, "tokens": 256, "tokens_per_s": None, "mfu": None}]
    out = fake_run(tmp_path / "r", rows, summary='{"comm_bytes": [1, 2], "step": 1}')
    text = report.run_page(out)
    comm = text.split('<section id="comm">')[1].split("</section>")[0]
    assert "<h2>comm (not drawn)</h2>" in comm
    assert "could not be drawn from the run&#x27;s files (AttributeError" in comm
    assert 'data-report="final-loss">6.0000<' in text and '<section id="loss">' in text

    def stubbed(out_dir):
        raise NotImplementedError(classroom.BY_ID["5a"].stub_message())
    monkeypatch.setattr(report, "run_page", stubbed)
    with pytest.raises(NotImplementedError, match="exercise 5a"):
        report.write_quietly(out)


def test_the_peak_is_set_against_the_plan_only_where_it_is_the_allocators(tmp_path):
    """On CUDA summary.json's peak_memory is the allocator's peak: drawn as the line the bars are
    measured against, and its ratio to the plan's peak given; on the CPU it is the process's
    resident set, a different quantity: said so, no ratio, no line."""
    from nanohlat import plan, recipe
    from nanohlat.run import report
    model, train = recipe.parse_args(TINY)
    mem = plan.memory_per_rank(model, train, 1, 1, 1, 0, fused=True, eager=True)
    rows = [{"step": 1, "loss": 6.0, "lr": 1e-3, "grad_norm": 1.0, "tokens": 256, "tokens_per_s": None, "mfu": None}]
    summary = json.dumps({"comm_bytes": {}, "param_bytes": mem["weights"], "grad_bytes": mem["flat_grads"],
                          "optimizer_bytes": mem["optimizer"], "peak_memory": mem["peak"] // 2, "step": 1})
    pages = {kind: report.run_page(fake_run(tmp_path / kind, rows, summary=summary, kind=kind))
             for kind in ("cuda", "cpu")}
    cuda, cpu = (p.split('<section id="memory">')[1].split("</section>")[0] for p in (pages["cuda"], pages["cpu"]))
    assert "measured / plan 0.50" in cuda and "measured peak" in cuda and 'stroke-dasharray="5 3"' in cuda
    assert "torch.cuda.max_memory_allocated" in cuda
    assert "not the same quantity (below)" in cpu and "measured / plan" not in cpu and "stroke-dasharray" not in cpu
    assert "ru_maxrss" in cpu
    assert cuda.count("<td>same</td>") == cpu.count("<td>same</td>") == 3
