"""The debugging lab's `compare A B --html FILE` (classroom/lab.py, issue 60): both runs' report
pages side by side in FILE, opened in headless Chromium with no console error; a path the
page cannot be written to is refused in one line, exit 2, before anything is read or
written; a link at FILE is replaced, never followed."""

from __future__ import annotations

import json
import os

import pytest

from browser import browser, open_page


def final(out: str) -> tuple[int, float]:
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in line]
    return rows[-1]["step"], rows[-1]["loss"]


@pytest.mark.slow
def test_compare_writes_both_runs_side_by_side(cache_dir, tmp_path, capsys):
    import train
    from nanohlat.classroom import kit
    runs = []
    for name, lr in (("a", "3e-3"), ("b", "1e-3")):   # two runs that differ from step 2 on (the lr)
        runs.append(str(tmp_path / name))
        assert train.main(["--preset", "tiny", "--steps", "3", "--eval-every", "0", "--lr", lr, "--no-progress",
                           "--cache-dir", cache_dir, "--out-dir", runs[-1]]) == 0
    page_path = tmp_path / "compare.html"
    capsys.readouterr()
    assert kit.main(["compare", *runs, "--html", str(page_path)]) == 1   # they differ: the exit code is compare's
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == f"wrote {page_path}: both runs' reports side by side (A left, B right)"
    driver = browser()
    try:
        page = open_page(driver, str(page_path))
        assert page.errors() == []
        assert [page.find(f'[data-report="run-{n}"]').text for n in "ab"] == runs
        for n, run in zip("AB", runs):
            step, loss = final(run)
            assert page.find(f'.run-{n} [data-report="final-loss"]').text == f"{loss:.4f}"
            assert page.find(f'.run-{n} [data-report="steps"]').text == f"{step} (of 3)"
        # the two losses on one chart: a curve each
        assert len(page.find_all("body > svg polyline")) == 2
        page.screenshot(str(tmp_path / "compare.png"))
        assert os.path.getsize(tmp_path / "compare.png") > 10_000
    finally:
        driver.quit()


def runs_of_metrics(tmp_path) -> list[str]:
    """Two folders holding only a metrics.jsonl (what compare needs), the same steps."""
    out = []
    for name in "ab":
        os.makedirs(tmp_path / name)
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            f.write('{"step": 1, "loss": 6.25, "grad_norm": 1.0, "lr": 0.001}\n')
        out.append(str(tmp_path / name))
    return out


def test_compare_refuses_a_page_path_it_cannot_write_in_one_line(tmp_path, capsys):
    from nanohlat.classroom import kit
    a, b = runs_of_metrics(tmp_path)
    os.mkfifo(tmp_path / "fifo")
    os.makedirs(tmp_path / "folder")
    cases = {str(tmp_path / "folder"): "is a folder; give a file path",
             str(tmp_path / "fifo"): "is a FIFO (named pipe), not a regular file",
             str(tmp_path / "missing" / "x.html"): "does not exist; make it or choose another --html"}
    for path, said in cases.items():
        assert kit.main(["compare", a, b, "--html", path]) == 2, path
        out = capsys.readouterr()
        assert not out.out and out.err.startswith("error: ") and said in out.err and len(out.err.splitlines()) == 1
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "fifo", "folder"]   # nothing written, the FIFO left
    # a link at the page's name: replaced by the page, its target untouched; the runs' pages drawn from metrics alone
    (tmp_path / "victim").write_text("mine")
    os.symlink(tmp_path / "victim", tmp_path / "page.html")
    assert kit.main(["compare", a, b, "--html", str(tmp_path / "page.html")]) == 0
    assert (tmp_path / "victim").read_text() == "mine" and not os.path.islink(tmp_path / "page.html")
    text = (tmp_path / "page.html").read_text()
    assert text.count('data-report="final-loss">6.2500<') == 2 and "two runs compared" in text
