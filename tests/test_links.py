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
                                   "timeline.png", "run.lock", "checkpoints/latest",
                                   "checkpoints/.tmp_step_00000002/", "checkpoints/.tmp_step_00000004/",
                                   "checkpoints/step_00000004/"])
    # a dangling link at a temporary's name: following it would create its target
    os.symlink(tmp_path / "victims" / "metrics_created", out / "config.json.partial")
    code = train.main(TINY + ["--steps", "4", "--save-every", "2", "--timeline", "--cache-dir", cache_dir,
                              "--out-dir", str(out)])
    assert code == 0, capsys.readouterr().err
    assert_untouched(tmp_path, before)
    for name in ("config.json", "metrics.jsonl", "summary.json", "run.lock", "checkpoints/latest"):
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
    before = plant(tmp_path, out, ["eval.json", "eval_curves.png", "eval.json.partial"])
    before |= plant(tmp_path, tmp_path / "elsewhere", ["results.json"])
    for json_path in (None, tmp_path / "elsewhere" / "results.json"):
        argv = ["--out-dir", str(out), "--all-checkpoints", "--examples", "8", "--max-batches", "2"]
        code = evalpy.main(argv + (["--json", str(json_path)] if json_path else []))
        assert code in (0, None), capsys.readouterr().err
    assert_untouched(tmp_path, before)
    assert not os.path.islink(out / "eval.json") and not os.path.islink(tmp_path / "elsewhere" / "results.json")

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
