"""The planner page's numbers without a browser (the page itself: test_plan_page.py): every layout the page
holds reads what `--plan` prints for it; the shipped plan-vs-measured data is what the planner says now and
what the runs measured; --html and --measured refuse what they cannot use, in one line, writing nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest
import torch

import train
from nanohlat import plan, recipe
from nanohlat.plan import measured, page, page_data

WORLD = 8
TINY = ["--preset", "tiny", "--nproc", str(WORLD), "--device", "cuda"]   # (cuda: memory figures, eager)


def text_figures(text: str, device: str) -> dict:
    """The figures the page shows, read from --plan's text for one device: the peak, whether it fits,
    the step, bubble and MFU of its row of the time table."""
    peak = re.search(r"^  largest stage \d+: (\S+ \S+) of \S+ \S+ on one " + re.escape(device)
                     + r": (fits|does NOT fit)", text, re.M)
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("  device ") and " step " in line)
    header = re.split(r"\s{2,}", lines[head].strip())
    row = next(line for line in lines[head + 1:] if line.startswith(f"  {device}  "))
    cells = dict(zip(header, re.split(r"\s{2,}", row.strip())))
    return {"peak-bytes": peak.group(1), "fits": "fits" if peak.group(2) == "fits" else "does not fit",
            "step-time-s": cells["step"], "bubble": cells["bubble"], "mfu": cells["MFU"]}


def record_figures(data: dict, key: str, device: str) -> dict:
    r, s = data["layouts"][key], data["strings"]
    head = [s[i] for i in r["time_header"]]
    cells = dict(zip(head, [s[i] for i in r["time"][device]]))
    return {"peak-bytes": s[r["peak"]], "fits": s[r["fits"][device][0]], "step-time-s": cells["step"],
            "bubble": cells["bubble"], "mfu": cells["MFU"]}


def flags_of(key: str) -> list[str]:
    """The command line of --plan for a layout's key (page_data.CONTROLS' order)."""
    argv = []
    for name, value in zip(page_data.CONTROLS, key.split("|")):
        flag = page.flag_of(name)
        argv += [flag] if value == "on" else ["--no-" + flag[2:]] if value == "off" else [flag, value]
    return argv


def test_every_layout_on_the_page_reads_what_plan_prints():
    """All the layouts the page holds for tiny on 8 ranks (cuda: the H100's row and memory), each against
    the text of `--plan` with its flags: the peak, fit, step, bubble, MFU, and every memory and time cell."""
    cfg, tcfg = recipe.parse_args(TINY)
    data = page_data.page_data(cfg, tcfg, WORLD)
    assert len(data["layouts"]) > 100 and data["own"] in data["layouts"]
    s = data["strings"]
    for key, r in data["layouts"].items():
        c_cfg, c = recipe.parse_args(["--preset", "tiny", "--nproc", str(WORLD)] + flags_of(key))
        text = plan.report(c_cfg, c, WORLD)
        assert record_figures(data, key, "H100") == text_figures(text, "H100"), key
        memory_row = "  " + "  ".join(s[cell] for _, cell in r["memory"])
        assert re.sub(r"\s+", " ", memory_row) in {re.sub(r"\s+", " ", line) for line in text.splitlines()}, key
        assert sum(b for _, b, _ in r["bar"]) == r["peak_bytes"]


def test_page_holds_the_bounded_set():
    """ZeRO 0-3, every schedule and every micro-batch count the flags allow, at every tp x pp x dp of the world;
    the other flags as the command gave them."""
    cfg, tcfg = recipe.parse_args(TINY)
    data = page_data.page_data(cfg, tcfg, WORLD)
    keys = [dict(zip(page_data.CONTROLS, k.split("|"))) for k in data["layouts"]]
    assert {k["zero"] for k in keys} == {"0", "1", "2", "3"}
    assert {k["schedule"] for k in keys} == {"afab", "1f1b", "interleaved", "zb-h1"}
    assert {(k["tp"], k["pp"], k["dp"]) for k in keys} >= {("1", "1", "8"), ("2", "2", "2"), ("8", "1", "1"),
                                                          ("1", "4", "2")}
    assert {k["microbatches"] for k in keys if k["dp"] == "1"} == {"1", "2", "4", "8"}
    assert {k["precision"] for k in keys} == {"fp32"} and {k["seqlen"] for k in keys} == {"32"}


def test_a_batch_dp_cannot_split_is_held_at_the_smallest_that_it_can():
    """hlat-7b's batch of 1024 at dp 2048 (tp 1, pp 1): the page holds it at --batch-size 2048, and says so."""
    cfg, tcfg = recipe.parse_args(["--preset", "hlat-7b", "--nproc", "2048", "--tp", "1", "--pp", "1"])
    layouts = list(page_data.variants(cfg, dataclasses.replace(tcfg, tp=8), 2048))
    alone = [c for c in layouts if (c.tp, c.pp) == (1, 1)]
    assert alone and {c.batch_size for c in alone} == {2048} and {c.microbatches for c in alone} == {1}
    assert {c.batch_size for c in layouts if c.tp == 8 and c.pp == 1} == {1024}


def same_experts_kernel(data: dict) -> bool:
    """Whether this torch takes the experts' path the shipped data's torch took. A mixture's experts take
    F.grouped_mm's path where torch has it (>= 2.10: moe.grouped_by_shape), and the plan counts what that
    path keeps: under a torch on the other side of 2.10 (the torch 2.9 lane) a mixture's peak is planned
    for another kernel than the shipped plan's, so the tests below leave that one figure out there."""
    made_with = tuple(int(n) for n in data["machine"]["torch"].split("+")[0].split(".")[:2])
    return hasattr(torch.nn.functional, "grouped_mm") == (made_with >= (2, 10))


def without_mixture_peaks(data: dict) -> dict:
    """The data with each mixture's planned peak left out (see same_experts_kernel)."""
    data = json.loads(json.dumps(data))
    for run in data["runs"].values():
        if run["config"]["model"].get("moe_experts"):
            run["planned"].pop("peak")
    return data


def test_shipped_plan_is_what_the_planner_says_now():
    """nanohlat/plan/layout_matrix_measured.json (scripts/layout_matrix.py --plan-vs-measured): its planned side
    recomputed from each run's config.json equals what was shipped, so a planner change that moves any of
    these figures fails here until the data is made again."""
    data = measured.shipped()
    assert "--plan-vs-measured" in data["command"] and len(data["runs"]) >= 12
    for name, run in data["runs"].items():
        now, shipped = measured.planned(run["config"]), dict(run["planned"])
        if run["config"]["model"].get("moe_experts") and not same_experts_kernel(data):
            del now["peak"], shipped["peak"]
        assert now == shipped, name


def test_shipped_measurements_against_the_plan():
    """What the runs measured: every dense layout's weights, fp32 gradients, Adam state, micro-batches in flight
    and every collective's payload, wire bytes and calls equal the plan's; a mixture's all-to-alls follow its
    router (the plan counts balanced routing): their errors are shown, not zero; the cpu peak is not compared."""
    runs = measured.shipped()["runs"]
    for name, run in runs.items():
        rows = {r["term"]: r for r in measured.compare(run["config"], run["summary"])}
        assert rows["peak"]["measured"] is None and rows["peak"]["error"] is None   # (cpu: the resident set)
        for term, r in rows.items():
            if term != "peak" and not term.startswith("ep.all_to_all"):
                assert r["error"] == 0.0, (name, term, r)
    ep = {t: r for t, r in (( r["term"], r) for r in measured.compare(runs["moe_ep2"]["config"],
                                                                       runs["moe_ep2"]["summary"]))}
    assert ep["ep.all_to_all payload"]["error"] not in (None, 0.0)


def test_measured_reads_a_run_folder(tmp_path):
    run = measured.shipped()["runs"]["dp2_z1"]
    for name in ("config", "summary"):
        (tmp_path / f"{name}.json").write_text(json.dumps(run[name]))
    config, summary = measured.read_run(str(tmp_path))
    assert measured.compare(config, summary) == measured.compare(run["config"], run["summary"])


@pytest.mark.parametrize("make,why", [
    ("link", "is a symbolic link"), ("fifo", "FIFO"), ("folder", "a folder"), ("nofolder", "not a folder")])
def test_html_refusals(tmp_path, capsys, make, why):
    target = tmp_path / "plan.html"
    if make == "link":
        (tmp_path / "elsewhere.html").write_text("kept")
        os.symlink(tmp_path / "elsewhere.html", target)
    elif make == "fifo":
        os.mkfifo(target)
    elif make == "folder":
        target.mkdir()
    else:
        target = tmp_path / "missing" / "plan.html"
    before = sorted(os.listdir(tmp_path))
    assert train.main(["--preset", "tiny", "--plan", "--html", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert why in err and len(err.splitlines()) == 1 and "--html" in err, err
    assert sorted(os.listdir(tmp_path)) == before
    if make == "link":
        assert (tmp_path / "elsewhere.html").read_text() == "kept"


def test_flag_refusals(tmp_path, capsys):
    out = str(tmp_path / "plan.html")
    assert train.main(["--preset", "tiny", "--html", out]) == 2
    assert "--html" in (err := capsys.readouterr().err) and "needs --plan" in err
    assert train.main(["--preset", "tiny", "--plan", "--measured", str(tmp_path)]) == 2
    assert "needs --html" in capsys.readouterr().err
    assert train.main(["--preset", "tiny", "--plan", "--html", out, "--measured", str(tmp_path)]) == 2
    assert "has no config.json or summary.json" in capsys.readouterr().err
    assert not os.path.exists(out)


def test_a_page_whose_write_fails_leaves_the_old_one(tmp_path, monkeypatch):
    """The page goes through the atomic writer: a write that fails (here its fsync: a full disk) leaves the
    page that was there, and no temporary."""
    from nanohlat.system import files
    out = tmp_path / "plan.html"
    out.write_text("the old page")

    def full(fd):
        raise OSError(28, "No space left on device")
    cfg, tcfg = recipe.parse_args(["--preset", "tiny", "--plan", "--html", str(out)])
    monkeypatch.setattr(files.os, "fsync", full)
    with pytest.raises(OSError):
        page.write(cfg, tcfg, 1, [])
    assert out.read_text() == "the old page" and sorted(os.listdir(tmp_path)) == ["plan.html"]


def test_the_peak_is_compared_where_it_is_the_allocators():
    """A cuda run's summary.json peak is torch.cuda.max_memory_allocated: set beside the plan's peak for that
    config (eager, fused attention), the error is plan / measured - 1; a cpu run's (the resident set) never."""
    run = measured.shipped()["runs"]["dp2"]
    config = dict(run["config"], train=dict(run["config"]["train"], device="cuda"))
    cfg, tcfg, world = measured.configs_of(config)
    peak = plan.memory_per_rank(cfg, tcfg, tcfg.tp, tcfg.pp, world // tcfg.tp, 0, fused=True, eager=True)["peak"]
    rows = {r["term"]: r for r in measured.compare(config, dict(run["summary"], peak_memory=peak * 2))}
    assert rows["peak"]["planned"] == peak and rows["peak"]["error"] == -0.5
    assert page.error_text(rows["peak"]["error"]) == "-50.0%"
    rows = {r["term"]: r for r in measured.compare(run["config"], dict(run["summary"], peak_memory=peak * 2))}
    assert rows["peak"]["measured"] is None


def test_the_script_writes_the_shipped_data_again(tmp_path):
    """scripts/layout_matrix.py --plan-vs-measured's writer, given the shipped runs' files as its runs, writes
    what the repository ships (the runs themselves: `python scripts/layout_matrix.py --only ...`, its
    command in the file; tests/repo/test_layout_matrix.py trains the matrix's sample)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "layout_matrix", os.path.join(os.path.dirname(train.__file__), "scripts", "layout_matrix.py"))
    matrix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(matrix)
    shipped = measured.shipped()
    results = {name: {"nproc": r["nproc"], "flags": r["flags"], "config": r["config"], "summary": r["summary"]}
               for name, r in shipped["runs"].items()}
    argv = shipped["command"].split()[2:]
    matrix.write_plan_vs_measured(str(tmp_path / "again.json"), results, shipped["machine"], argv)
    again = json.loads((tmp_path / "again.json").read_text())
    if not same_experts_kernel(shipped):
        again, shipped = without_mixture_peaks(again), without_mixture_peaks(shipped)
    assert again == shipped
    assert sorted(shipped["runs"]) == sorted(matrix.PLAN_VS_MEASURED + ["one", "one:moe"])


def test_the_command_a_missing_combination_names_keeps_the_model_flags():
    """For a combination it does not hold, the page names the command that prints it: the command line given
    (the model's flags too), less the controls' flags, whose values it appends, and the page's own."""
    argv = ["--preset", "tiny", "--nproc", "8", "--tp", "2", "--n-layers", "8", "--sequence-parallel", "--plan",
            "--html", "a b.html", "--measured", "run1", "run2", "--zero=1", "--search", "--lr", "1e-3"]
    assert page.base_command(argv) == "python train.py --preset tiny --nproc 8 --n-layers 8 --lr 1e-3"
