"""No file is ever written through a symbolic link (issue 25): links planted at
every path a run, an eval and an export write, pointing at victim files outside
the out-dir, leave every victim byte for byte as it was; the run, the eval and
the export still succeed (a link at one of our names is replaced by the file)."""

from __future__ import annotations

import os

import pytest


TINY = ["--preset", "tiny", "--eval-every", "0", "--no-progress", "--threads", "1"]


def plant(tmp_path, folder, names) -> dict:
    """A link at each of `names` under `folder`, to its own victim file (or, for a
    name ending in '/', a victim folder holding a file); returns victim -> bytes."""
    victims = tmp_path / "victims"
    victims.mkdir(exist_ok=True)
    before = {}
    for name in names:
        link = folder / name.rstrip("/")
        link.parent.mkdir(parents=True, exist_ok=True)
        target = victims / (name.rstrip("/").replace("/", "_") + "_victim")
        if name.endswith("/"):
            target.mkdir()
            (target / "inside").write_bytes(b"mine, a folder's file\n")
            before[str(target / "inside")] = b"mine, a folder's file\n"
        else:
            target.write_bytes(f"mine: {name}\n".encode())
            before[str(target)] = target.read_bytes()
        os.symlink(target, link)
    return before


def assert_untouched(tmp_path, before: dict) -> None:
    for path, data in before.items():
        with open(path, "rb") as f:
            assert f.read() == data, f"{path} was written through a link"
    assert sorted(os.listdir(tmp_path / "victims")) == sorted(
        {os.path.relpath(p, tmp_path / "victims").split(os.sep)[0] for p in before}), "a victim was created"


def test_train_never_writes_through_a_link(cache_dir, tmp_path, capsys):
    import train
    from nanohlat.run import checkpoint
    out = tmp_path / "run"
    out.mkdir()
    # every file a run writes into its out-dir, and a checkpoint's names
    before = plant(tmp_path, out, ["config.json", "metrics.jsonl", "summary.json", "timeline.txt",
                                   "timeline.png", "timeline.json", "report.html", "run.lock", "checkpoints/latest",
                                   "checkpoints/.tmp_step_00000002/", "checkpoints/.tmp_step_00000004/",
                                   "checkpoints/step_00000004/"])
    # a dangling link at a temporary's name: following it would create its target
    os.symlink(tmp_path / "victims" / "metrics_created", out / "config.json.partial")
    code = train.main(TINY + ["--steps", "4", "--save-every", "2", "--timeline", "--cache-dir", cache_dir,
                              "--out-dir", str(out)])
    assert code == 0, capsys.readouterr().err
    assert_untouched(tmp_path, before)
    for name in ("config.json", "metrics.jsonl", "summary.json", "report.html", "run.lock", "checkpoints/latest"):
        assert not os.path.islink(out / name), name          # replaced by the run's own file
    assert not any(os.path.islink(p) for p in (out / "checkpoints").iterdir())
    assert (out / "config.json").read_text().startswith("{")
    assert checkpoint.latest(str(out)) == str(out / "checkpoints" / "step_00000004")
    assert '"loss"' in (out / "metrics.jsonl").read_text()

    # a resumed run: links at the files it appends to or rewrites, again replaced
    for name in ("summary.json", "config.json"):
        os.remove(out / name)
    metrics = (out / "metrics.jsonl").read_bytes()
    os.replace(out / "metrics.jsonl", tmp_path / "metrics_kept")
    before2 = plant(tmp_path, out, ["summary.json", "config.json"])
    os.symlink(tmp_path / "metrics_kept", out / "metrics.jsonl")  # a link to the run's own records
    code = train.main(TINY + ["--steps", "6", "--save-every", "2", "--cache-dir", cache_dir, "--out-dir", str(out)])
    assert code == 0, capsys.readouterr().err
    assert_untouched(tmp_path, before | before2)
    assert (tmp_path / "metrics_kept").read_bytes() == metrics
    assert not os.path.islink(out / "metrics.jsonl")
    assert (out / "metrics.jsonl").read_text().startswith(metrics.decode())


def test_eval_and_export_never_write_through_a_link(cache_dir, tmp_path, capsys):
    pytest.importorskip("safetensors")
    import eval as evalpy
    import train
    from nanohlat.serving import hf
    out = tmp_path / "run"
    assert train.main(TINY + ["--steps", "2", "--save-every", "1", "--cache-dir", cache_dir, "--out-dir", str(out)]) == 0
    os.remove(out / "report.html")   # (the run's; eval.py draws it again with its table)
    before = plant(tmp_path, out, ["eval.json", "eval_curves.png", "eval.json.partial", "report.html"])
    before |= plant(tmp_path, tmp_path / "elsewhere", ["results.json"])
    for json_path in (None, tmp_path / "elsewhere" / "results.json"):
        argv = ["--out-dir", str(out), "--all-checkpoints", "--examples", "8", "--max-batches", "2"]
        code = evalpy.main(argv + (["--json", str(json_path)] if json_path else []))
        assert code in (0, None), capsys.readouterr().err
    assert_untouched(tmp_path, before)
    assert not os.path.islink(out / "eval.json") and not os.path.islink(tmp_path / "elsewhere" / "results.json")
    assert not os.path.islink(out / "report.html") and "eval.py (eval.json)" in (out / "report.html").read_text()

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    before |= plant(tmp_path, hf_dir, ["config.json", "model.safetensors", "tokenizer.model",
                                      "tokenizer_config.json", "model.safetensors.partial"])
    hf.main(["export", str(out), str(hf_dir), "--overwrite"])    # a folder with files in it: --overwrite
    assert_untouched(tmp_path, before)
    for name in ("config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json"):
        assert (hf_dir / name).is_file() and not os.path.islink(hf_dir / name), name
    hf.read_hf_dir(str(hf_dir))    # and the export reads back


def test_files_helpers_replace_links_and_never_follow_them(tmp_path):
    from nanohlat.system import files
    from nanohlat.run.trainlog import MetricsWriter
    victim = tmp_path / "victim"
    victim.write_bytes(b"mine\n")
    missing = tmp_path / "never_created"
    out = tmp_path / "out"
    out.mkdir()
    # a link at the name, and at the temporary's name (to a file, and dangling)
    os.symlink(victim, out / "a.json")
    os.symlink(missing, out / "a.json.partial")
    files.write_text(str(out / "a.json"), "{}")
    os.symlink(missing, out / "b.json")
    files.write_text(str(out / "b.json"), "[]")
    # metrics.jsonl appended to: a dangling link there would create its target if followed
    os.symlink(missing, out / "metrics.jsonl")
    with MetricsWriter(str(out)) as w:
        w.write({"step": 1})
    os.symlink(victim, out / "c.jsonl")
    with files.open_append(str(out / "c.jsonl")) as f:
        f.write("x\n")
    assert victim.read_bytes() == b"mine\n" and not missing.exists() and not os.path.lexists(out / "a.json.partial")
    assert [(out / n).read_text() for n in ("a.json", "b.json", "metrics.jsonl", "c.jsonl")] == \
        ["{}", "[]", '{"step": 1}\n', "x\n"]
    assert not any(os.path.islink(out / n) for n in os.listdir(out))
    with files.open_append(str(out / "c.jsonl")) as f:    # a regular file of ours is continued
        f.write("y\n")
    assert (out / "c.jsonl").read_text() == "x\ny\n"


def test_removing_a_linked_checkpoint_folder_removes_the_link_only(tmp_path):
    from nanohlat.run.checkpoint import history
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "inside").write_bytes(b"mine\n")
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    os.symlink(victim, root / "step_00000002")     # e.g. an incomplete checkpoint to clear
    history.remove_checkpoint(str(root / "step_00000002"))
    assert os.listdir(root) == [] and (victim / "inside").read_bytes() == b"mine\n"


# ---------------------------------------------------------------------------
# Not a file: a FIFO, a device, where a command writes (issue 50)
# ---------------------------------------------------------------------------

def make_node(path, kind: str) -> os.stat_result:
    """A FIFO, or a character device with /dev/full's numbers (root only: skipped otherwise),
    at `path`; returns its lstat. Never opened: that would block (a FIFO) or write to the device."""
    import stat
    if kind == "fifo":
        os.mkfifo(path)
    else:
        if os.geteuid() != 0:
            pytest.skip("os.mknod of a character device needs root")
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 7))
    return os.lstat(path)


@pytest.fixture(scope="module")
def small_run(cache_dir, tmp_path_factory):
    """A 2-step run and its Hugging Face export, for the commands that read one."""
    pytest.importorskip("safetensors")
    import train
    from nanohlat.serving import hf
    root = tmp_path_factory.mktemp("small")
    assert train.main(TINY + ["--steps", "2", "--cache-dir", cache_dir, "--out-dir", str(root / "run")]) == 0
    hf.main(["export", str(root / "run"), str(root / "hf")])
    return root


# command, where the node stands (under the case's folder D), argv (RUN: the run, HF: its export)
NOT_A_FILE = {
    "eval --json": ("node", ["eval", "--out-dir", "RUN", "--json", "NODE"]),
    "eval's eval.json": ("D/eval.json", ["eval", "--out-dir", "D"]),
    "eval's eval_curves.png": ("D/eval_curves.png", ["eval", "--out-dir", "D", "--all-checkpoints"]),
    "eval's report.html": ("D/report.html", ["eval", "--out-dir", "D", "--all-checkpoints"]),
    "train --out-dir": ("node", ["train", "--out-dir", "NODE"]),
    "train's metrics.jsonl": ("D/metrics.jsonl", ["train", "--out-dir", "D"]),
    "train's run.lock": ("D/run.lock", ["train", "--out-dir", "D"]),
    "train's report.html": ("D/report.html", ["train", "--out-dir", "D"]),
    "train's checkpoints/latest": ("D/checkpoints/latest", ["train", "--out-dir", "D"]),
    "hf export HF_DIR": ("node", ["hf", "export", "RUN", "NODE"]),
    "hf export --overwrite's model.safetensors": ("D/model.safetensors", ["hf", "export", "RUN", "D", "--overwrite"]),
    "hf import OUT_DIR": ("node", ["hf", "import", "HF", "NODE"]),
    "hf import --overwrite's run.lock": ("D/run.lock", ["hf", "import", "HF", "D", "--overwrite"]),
    "classroom new DIR": ("node", ["classroom", "new", "NODE"]),
}


@pytest.mark.parametrize("kind", ["fifo", "character device"])
@pytest.mark.parametrize("case", sorted(NOT_A_FILE))
def test_a_fifo_or_a_device_where_a_command_writes_is_refused_and_left_as_it_was(case, kind, small_run, cache_dir,
                                                                                   tmp_path, capsys):
    """Written over, a FIFO or a device became a file of ours (eval.py --json replaced the system's
    /dev/full, exit 0): every command that writes refuses one in one line, exit 2, before any work."""
    import shutil
    import eval as evalpy
    import train
    from nanohlat.classroom import kit
    from nanohlat.serving import hf
    where, argv = NOT_A_FILE[case]
    d = tmp_path / "d"
    if where.startswith("D/"):
        if argv[0] == "eval":
            shutil.copytree(small_run / "run", d)
        if argv[0] == "hf" and argv[1] == "import":
            shutil.copytree(small_run / "run", d)
        (d / where[2:]).parent.mkdir(parents=True, exist_ok=True)
    node = tmp_path / "node" if where == "node" else d / where[2:]
    if os.path.lexists(node):
        os.remove(node)          # (a run keeps its run.lock)
    before = make_node(node, kind)
    names = {"RUN": str(small_run / "run"), "HF": str(small_run / "hf"), "NODE": str(node), "D": str(d)}
    args = [names.get(a, a) for a in argv[1:]]
    main = {"eval": evalpy.main, "train": lambda a: train.main(TINY + ["--steps", "2", "--cache-dir", cache_dir] + a),
            "hf": hf.main, "classroom": kit.main}[argv[0]]
    code = main(args)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert str(node) in err and ("FIFO" if kind == "fifo" else "character device") in err, err
    after = os.lstat(node)
    assert (after.st_mode, after.st_ino, after.st_rdev) == (before.st_mode, before.st_ino, before.st_rdev)
    assert not os.path.lexists(str(node) + ".partial") and not os.path.lexists(str(node) + ".tmp")


def test_the_writers_themselves_refuse_a_fifo(tmp_path):
    """The last guard, under every command's own check: atomic_write and open_append refuse
    a FIFO at the name or at its `.partial` (open_append's open would block on one)."""
    from nanohlat.config import UserError
    from nanohlat.system import files
    os.mkfifo(tmp_path / "a.json")
    os.mkfifo(tmp_path / "b.json.partial")
    for call in (lambda: files.write_text(str(tmp_path / "a.json"), "{}"),
                 lambda: files.write_text(str(tmp_path / "b.json"), "{}"),
                 lambda: files.open_append(str(tmp_path / "a.json"))):
        with pytest.raises(UserError, match="is a FIFO"):
            call()
    assert sorted(os.listdir(tmp_path)) == ["a.json", "b.json.partial"]
