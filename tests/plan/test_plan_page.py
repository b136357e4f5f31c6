"""The planner page (`train.py --plan --html FILE`, plan/page.py) in headless Chromium (tests/browser.py):
no console error; setting the controls to a layout makes its figures read what `--plan` prints for it,
including layouts that do not fit; HLAT-7B's own layout on 2048 ranks, and tp 1 pp 1 dp 2048 not fitting;
a combination the page does not hold shows no number; the ranking sorts and chooses; the plan against the
layout matrix's measurements and a --measured run are shown. A screenshot of each page stays in the
test's temporary folder. (The same figures for every layout, without a browser: test_plan_page_data.py.)"""

from __future__ import annotations

import json
import os

import pytest

import train
from browser import browser, open_page
from nanohlat import plan, recipe
from nanohlat.plan import measured, page
from test_plan_page_data import text_figures

FIGURES = ("peak-bytes", "fits", "step-time-s", "bubble", "mfu")
HLAT = ["--preset", "hlat-7b", "--nproc", "2048"]


@pytest.fixture(scope="module")
def driver():
    d = browser()
    yield d
    d.quit()


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """The pages: tiny on 8 ranks (cuda: the H100's figures) with a --measured run, and HLAT-7B on 2048."""
    folder = tmp_path_factory.mktemp("pages")
    run = folder / "run"
    run.mkdir()
    shipped = measured.shipped()["runs"]["dp2_z2"]
    for name in ("config", "summary"):
        (run / f"{name}.json").write_text(json.dumps(shipped[name]))
    tiny = ["--preset", "tiny", "--nproc", "8", "--device", "cuda", "--plan", "--html", str(folder / "tiny.html"),
            "--measured", str(run)]
    assert train.main(tiny) == 0
    assert train.main(HLAT + ["--plan", "--html", str(folder / "hlat.html")]) == 0
    return folder


def choose(p, **values):
    """Set the controls as a user would (each <select> by its value), then read the figures."""
    from selenium.webdriver.support.ui import Select
    for name, value in values.items():
        Select(p.find(f'select[name="{name}"]')).select_by_value(str(value))
    return {name: p.find(f'[data-plan="{name}"]').text for name in FIGURES}


def planned_row(argv: list[str], device: str) -> str:
    """The step time --plan prints for `device`, a row of its time table (one with no fits line: trn1n)."""
    import re
    cfg, tcfg = recipe.parse_args(argv)
    lines = plan.report(cfg, tcfg, tcfg.nproc).splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("  device ") and " step " in line)
    header = re.split(r"\s{2,}", lines[head].strip())
    row = next(line for line in lines[head + 1:] if line.startswith(f"  {device}  "))
    return dict(zip(header, re.split(r"\s{2,}", row.strip())))["step"]


def plan_texts(p) -> dict:
    """Every element's data-plan name -> its text, read in one call."""
    return p.driver.execute_script('const out = {}; document.querySelectorAll("[data-plan]").forEach('
                                   'e => out[e.dataset.plan] = e.textContent); return out')


def planned(argv: list[str], device: str) -> dict:
    cfg, tcfg = recipe.parse_args(argv)
    return text_figures(plan.report(cfg, tcfg, tcfg.nproc), device)


@pytest.mark.parametrize("layout", [dict(tp=2, pp=2, dp=2, zero=1), dict(tp=1, pp=1, dp=8, zero=3),
                                    dict(tp=1, pp=4, dp=2, zero=0, schedule="zb-h1", microbatches=4),
                                    dict(tp=8, pp=1, dp=1, zero=2)])
def test_tiny_layouts_read_what_plan_prints(driver, pages, layout):
    p = open_page(driver, str(pages / "tiny.html"))
    shown = choose(p, hardware="H100", **layout)
    argv = ["--preset", "tiny", "--nproc", "8", "--device", "cuda"] + [
        a for k, v in layout.items() if k != "dp" for a in (page.flag_of(k), str(v))]
    assert shown == planned(argv, "H100"), layout
    assert p.find('[data-plan="missing"]').get_attribute("hidden") is not None
    assert p.errors() == []


def test_hlat_7b_own_layout_and_one_that_does_not_fit(driver, pages, tmp_path):
    p = open_page(driver, str(pages / "hlat.html"))
    assert p.errors() == []
    own = {name: p.find(f'[data-plan="{name}"]').text for name in FIGURES}   # (as written: the preset's layout)
    assert own == planned(HLAT, "NeuronCore-v2") and own["fits"] == "fits"
    assert own == choose(p, tp=8, pp=1, dp=256, zero=0)
    # tp 1 pp 1 dp 2048: 1024 sequences do not split over 2048 ranks; the page says so, and holds it at 2048
    choose(p, tp=1, pp=1, dp=2048)
    assert "--batch-size 2048" in p.find('[data-plan="missing"]').text
    alone = choose(p, batchsize=2048, microbatches=1)
    assert alone == planned(HLAT + ["--tp", "1", "--batch-size", "2048", "--microbatches", "1"], "NeuronCore-v2")
    assert alone["fits"] == "does not fit"
    trn1n = choose(p, hardware="NeuronCore-v2 (trn1n)")   # (the same NeuronCore, faster EFA: its own step time)
    assert trn1n["fits"] == "does not fit" and trn1n["peak-bytes"] == alone["peak-bytes"]
    assert trn1n["step-time-s"] == planned_row(HLAT + ["--tp", "1", "--batch-size", "2048", "--microbatches", "1"],
                                               "NeuronCore-v2 (trn1n)")
    choose(p, hardware="NeuronCore-v2")
    # another that does not fit (6.74B parameters over tp 2: 33 GiB a rank), and with ZeRO-1 and pp 2 still not
    for layout, flags in ((dict(tp=2, pp=1, dp=1024, zero=0, batchsize=1024), ["--tp", "2", "--microbatches", "1"]),
                          (dict(tp=2, pp=2, dp=512, zero=1, schedule="afab"),
                           ["--tp", "2", "--pp", "2", "--zero", "1", "--schedule", "afab", "--microbatches", "1"])):
        shown = choose(p, microbatches=1, **layout)
        assert shown == planned(HLAT + flags, "NeuronCore-v2") and shown["fits"] == "does not fit", layout
    p.screenshot(str(tmp_path / "plan-hlat-7b.png"))
    assert os.path.getsize(tmp_path / "plan-hlat-7b.png") > 10_000


def test_a_combination_not_held_shows_no_number(driver, pages):
    p = open_page(driver, str(pages / "tiny.html"))
    assert choose(p, precision="bf16-mixed") == dict.fromkeys(FIGURES, "")
    missing = p.find('[data-plan="missing"]')
    assert missing.is_displayed() and "--precision bf16-mixed" in missing.text and "--plan" in missing.text
    assert choose(p, precision="fp32")["peak-bytes"] != ""


def test_search_table_sorts_and_chooses(driver, pages):
    p = open_page(driver, str(pages / "tiny.html"))
    head = [th.text.split(" ")[0] for th in p.find_all("#search tr th")]
    rows = lambda: p.driver.execute_script(   # (one call: a WebDriver round trip per cell takes minutes)
        'return [...document.querySelectorAll("#search tr.row")].map(r => [...r.cells].map(c => c.textContent))')
    first = rows()
    assert [int(r[0]) for r in first] == list(range(1, len(first) + 1)) and len(first) > 20
    peak = head.index("peak")
    p.find_all("#search tr th")[peak].click()
    by_peak = rows()
    sizes = [r[peak] for r in by_peak]
    assert sizes != [r[peak] for r in first] and sorted(by_peak, key=lambda r: int(r[0])) == first
    ckpt, sp, overlap = head.index("ckpt"), head.index("SP"), head.index("overlap")
    held = next(i for i, r in enumerate(by_peak) if (r[ckpt], r[sp], r[overlap]) == ("none", "-", "on"))
    p.find_all("#search tr.row")[held].click()   # the smallest peak with the command's other flags: chosen above
    assert p.find('[data-plan="peak-bytes"]').text == sizes[held]
    assert [p.find(f'select[name="{n}"]').get_attribute("value") for n in ("tp", "pp", "dp")] == \
        [by_peak[held][head.index(n)] for n in ("tp", "pp", "dp")]
    assert p.errors() == []


def test_plan_against_measurement_is_shown(driver, pages, tmp_path):
    p = open_page(driver, str(pages / "tiny.html"))
    runs, shown = measured.shipped()["runs"], plan_texts(p)
    errors = {}
    for name, run in runs.items():
        for r in measured.compare(run["config"], run["summary"]):
            cell = shown[f'matrix-{page.slug(name)}-{page.slug(r["term"])}']
            assert cell == page.error_text(r["error"]), (name, r)
            kind = r["term"].split(" ")[-1] if r["term"].split(" ")[-1] in measured.COMM_FIGURES else r["term"]
            errors.setdefault(kind, []).append(r["error"])
    for kind in ("weights", "Adam", "fp32 grads", "in flight", "payload", "wire", "calls"):
        worst = max((e for e in errors[kind] if e is not None), key=abs)
        assert shown[f"matrix-error-{page.slug(kind)}"] == page.error_text(worst)
    assert shown["matrix-error-payload"] not in ("same", "-")   # (a mixture's all-to-all follows its router)
    assert shown["given-error-weights"] == "same"               # the --measured run: dp2_z2's files
    assert p.find('[data-plan="matrix-error-weights"]').is_displayed()
    p.screenshot(str(tmp_path / "plan-tiny.png"))
    assert p.errors() == []


def test_the_page_is_self_contained(pages):
    """No network: nothing the page would load (no src, href, @import or url()), its script and data inline."""
    for name in ("tiny.html", "hlat.html"):
        text = (pages / name).read_text()
        assert not any(s in text for s in (" src=", " href=", "@import", "url(")), name
        assert text.count("<script") == 2 and 'id="plan-data"' in text
