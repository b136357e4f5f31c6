"""Hostile files (docs/robustness.md; the shared helpers: hostile.py): checkpoints that are
incomplete, moved or of another tokenizer; token caches that are damaged, data that is no regular
file; manifests, configs, Hugging Face configs and metrics lines that are damaged; weights and
figures that are not finite; and the messages that name the right thing."""

from __future__ import annotations

import json
import os

import pytest

from hostile import ckpt, flags, losses, main_in_process, one_line_error, _edit_manifest, _export
from hostile import base, run_copy, small_corpus  # (fixtures: pytest finds them where they are imported)


# ---------------------------------------------------------------------------
# Checkpoints: incomplete ones, older ones, identity, Hugging Face targets
# ---------------------------------------------------------------------------

def test_a_run_moved_away_from_its_tokenizer_cache_still_samples(run_copy, capsys):
    """Each checkpoint holds a copy of the run's tokenizer: with the cached
    original gone (a cleared cache, the run copied to another machine),
    sample.py, eval.py and the rest load the copy."""
    import filecmp
    import sample
    from nanohlat.run import checkpoint
    path = ckpt(run_copy, 4)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    assert filecmp.cmp(os.path.join(path, "tokenizer.model"), manifest["tokenizer"], shallow=False)
    manifest["tokenizer"] = str(run_copy / "gone" / "tokenizer.model")     # the original, somewhere else
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    assert checkpoint.read_manifest(path)["tokenizer"] == os.path.join(path, "tokenizer.model")
    assert sample.main(["--out-dir", str(run_copy), "--max-new-tokens", "4", "--prompt", "def "]) == 0
    assert capsys.readouterr().out.startswith("def ")


def test_a_checkpoint_without_manifest_is_skipped_named_and_cleared(run_copy, cache_dir, capsys):
    from nanohlat.run import checkpoint
    os.remove(os.path.join(ckpt(run_copy, 4), "manifest.json"))
    os.makedirs(os.path.join(run_copy, "checkpoints", ".tmp_step_00000005"))
    code, err = main_in_process(flags(cache_dir, run_copy, "--steps", 6, "--save-every", 2), capsys)
    assert code == 0, err
    assert "warning: skipping incomplete checkpoint(s)" in err and "step_00000004" in err and ".tmp_step_" in err
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(run_copy))] == \
        ["step_00000002", "step_00000004", "step_00000006"]
    assert checkpoint.incomplete_checkpoints(str(run_copy)) == []
    assert sorted(losses(run_copy)) == [1, 2, 3, 4, 5, 6]


def test_resume_with_another_tokenizer_is_refused(run_copy, cache_dir, small_corpus, capsys):
    """The same vocabulary size, trained on other data: another tokenizer. Refused
    (exit 2, nothing changed); the message names the three ways on, and each works."""
    from nanohlat.run import checkpoint
    before = sorted(os.listdir(run_copy / "checkpoints"))
    code, err = main_in_process(flags(cache_dir, run_copy, "--steps", 6, "--data", small_corpus), capsys)
    assert code == 2
    one_line_error(err, "another tokenizer", "--resume never --overwrite", "--allow-tokenizer-change", "--tokenizer ")
    assert sorted(os.listdir(run_copy / "checkpoints")) == before and sorted(losses(run_copy)) == [1, 2, 3, 4]
    # new data, the run's own tokenizer: allowed, and said
    tokenizer = json.load(open(os.path.join(ckpt(run_copy, 4), "manifest.json")))["tokenizer"]
    code, err = main_in_process(flags(cache_dir, run_copy, "--steps", 5, "--data", small_corpus,
                                      "--tokenizer", tokenizer), capsys)
    assert code == 0, err
    assert "note: resuming" in err and "on other data" in err
    # deliberately another tokenizer
    code, err = main_in_process(flags(cache_dir, run_copy, "--steps", 6, "--data", small_corpus,
                                      "--allow-tokenizer-change"), capsys)
    assert code == 0, err
    assert "warning: resuming" in err and "another tokenizer" in err
    assert checkpoint.latest(str(run_copy)) == ckpt(run_copy, 6)


def test_hf_import_into_a_run_is_refused_and_its_checkpoints_stay(run_copy, tmp_path, capsys):
    pytest.importorskip("safetensors")
    from nanohlat.run import checkpoint
    from nanohlat.serving import hf
    hf.main(["export", str(run_copy), str(tmp_path / "hf")])
    before = {p: checkpoint.read_manifest(p)["files"] for p in checkpoint.list_checkpoints(str(run_copy))}
    for argv in (["import", str(tmp_path / "hf"), str(run_copy)],             # into a run
                 ["export", str(run_copy), str(tmp_path / "hf")]):            # over an earlier export
        assert hf.main(argv) == 2
        one_line_error(capsys.readouterr().err, "is not empty", "--overwrite")
    assert {p: checkpoint.read_manifest(p)["files"] for p in checkpoint.list_checkpoints(str(run_copy))} == before
    checkpoint.ShardSet(ckpt(run_copy, 4))
    # told --overwrite, import replaces the run; export rewrites the folder
    hf.main(["export", str(run_copy), str(tmp_path / "hf"), "--overwrite"])
    hf.main(["import", str(tmp_path / "hf"), str(run_copy), "--overwrite"])
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(run_copy))] == ["step_00000000"]


# ---------------------------------------------------------------------------
# Data: verified caches, files that are not text files
# ---------------------------------------------------------------------------

def test_a_truncated_token_cache_is_rebuilt_never_used(small_corpus, tmp_path):
    from nanohlat.run import data
    from nanohlat.config import UserError
    cache = str(tmp_path / "cache")
    first = data.prepare_data(str(small_corpus), "", 512, cache, log=lambda *a: None)
    tokens = first.train.copy()
    train_bin = os.path.join(first.directory, "train.bin")
    with open(train_bin, "r+b") as f:
        f.truncate(4096)
    with pytest.raises(UserError, match="damaged"):            # opened directly: refused, one line
        data.Dataset(first.tokenizer, first.directory)
    notes = []
    again = data.prepare_data(str(small_corpus), "", 512, cache, log=notes.append)
    assert any("damaged" in n and "train.bin has 4,096 bytes" in n and "rebuilding" in n for n in notes), notes
    assert (again.train == tokens).all() and len(again.train) == len(tokens)
    # same size, one changed block: the full hash notices
    with open(train_bin, "r+b") as f:
        f.write(b"\xff\xff" * 8)
    assert "does not match its hash" in data.verify_shards(again.directory)


def test_damaged_cache_that_cannot_be_rebuilt_is_one_line(small_corpus, tmp_path, monkeypatch):
    from nanohlat.run import data
    from nanohlat.config import UserError
    cache = str(tmp_path / "cache")
    first = data.prepare_data(str(small_corpus), "", 512, cache, log=lambda *a: None)
    os.remove(os.path.join(first.directory, "val.bin"))

    real = os.makedirs

    def read_only(path, *args, **kw):      # the cache dir exists; nothing new can be made in it
        if ".tmp-" in str(path):
            raise PermissionError(13, "Read-only file system", path)
        return real(path, *args, **kw)
    monkeypatch.setattr(data.os, "makedirs", read_only)
    with pytest.raises(UserError) as e:
        data.prepare_data(str(small_corpus), "", 512, cache, log=lambda *a: None)
    assert "cannot be built" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "broken symlink in a folder"])
def test_data_that_is_not_a_regular_file_is_refused(kind, small_corpus, tmp_path):
    import shutil
    from nanohlat.run import data
    from nanohlat.config import UserError
    if kind == "fifo":
        path = str(tmp_path / "pipe.txt")
        os.mkfifo(path)
    elif kind == "/dev/zero":
        path = "/dev/zero"
    else:
        path = str(tmp_path / "folder")
        shutil.copytree(small_corpus, path)
        os.symlink(str(tmp_path / "gone.py"), os.path.join(path, "link.py"))
    with pytest.raises(UserError) as e:
        data.prepare_data(path, "", 512, str(tmp_path / "cache"), log=lambda *a: None)
    msg = str(e.value)
    assert "\n" not in msg and ("broken symbolic link" in msg if "symlink" in kind else "not a regular file" in msg)


# ---------------------------------------------------------------------------
# Run files parsed defensively: damaged manifests, damaged metrics lines
# ---------------------------------------------------------------------------

DAMAGED_MANIFESTS = {
    "step": lambda m: m.update(step="4"),
    "tokens": lambda m: m.update(tokens=-1),
    "layout": lambda m: m["layout"].update(tp=0),
    "world": lambda m: m["layout"].update(world=3),
    "model": lambda m: m["config"]["model"].update(d_model="big"),
    "config": lambda m: m.update(config=[1, 2]),
    "files": lambda m: m.update(files={"../x.pt": {"bytes": 1, "sha256": "0" * 64}}),
    "checksum": lambda m: next(iter(m["files"].values())).update(sha256=5),
    "schedule": lambda m: m.update(schedule={"optimizer_step": "x"}),
    "tokenizer": lambda m: m.update(tokenizer=7),
    # the layout's ZeRO stage and chunks: each was trusted unchecked (a KeyError, ValueError or TypeError
    # deep in the load, or a wrong value silently accepted)
    "zero abc": lambda m: m["layout"].update(zero="abc"),
    "zero null": lambda m: m["layout"].update(zero=None),
    "zero 7": lambda m: m["layout"].update(zero=7),
    "zero1 abc": lambda m: m["layout"].update(zero1="abc"),
    "zero and zero1 gone": lambda m: [m["layout"].pop(k) for k in ("zero", "zero1")],
    "zero and zero1 disagree": lambda m: m["layout"].update(zero=0, zero1=True),
    "virtual_stages 0": lambda m: m["layout"].update(virtual_stages=0),
    "virtual_stages 2 at pp 1": lambda m: m["layout"].update(virtual_stages=2),
    "cp 0": lambda m: m["layout"].update(cp=0),                       # context parallelism's degree
    "cp 2, world not tp*pp*dp*cp": lambda m: m["layout"].update(cp=2),
    # fields read later and trusted: a traceback deep in the resume, or a wrong run silently
    "optimizer null": lambda m: m.update(optimizer=None),            # falsy: fresh Adam moments, silently
    "optimizer abc": lambda m: m.update(optimizer="abc"),
    "identity tokenizer_sha256 5": lambda m: m["identity"].update(tokenizer_sha256=5),   # a TypeError on resume
    "identity data 5": lambda m: m["identity"].update(data=5),
    "tokenizer_copy file 5": lambda m: m["tokenizer_copy"].update(file=5),
    "step not its folder's": lambda m: m.update(step=5),
    "bad_steps beyond step": lambda m: m["schedule"].update(bad_steps=10**12),   # stopped as "10^12 bad steps"
    "optimizer_step 10^30": lambda m: m["schedule"].update(optimizer_step=10**30),   # an OverflowError
    "tokens 10^30": lambda m: m.update(tokens=10**30),
}


@pytest.mark.parametrize("field", sorted(DAMAGED_MANIFESTS))
def test_a_damaged_manifest_is_one_line_on_resume_sample_eval_and_export(field, run_copy, cache_dir, capsys, tmp_path):
    import eval as evalpy
    import sample
    path = os.path.join(ckpt(run_copy, 4), "manifest.json")
    with open(path) as f:
        m = json.load(f)
    DAMAGED_MANIFESTS[field](m)
    with open(path, "w") as f:
        json.dump(m, f)
    code, err = main_in_process(flags(cache_dir, run_copy, "--steps", 6, "--resume", "auto"), capsys)
    assert code == 2
    one_line_error(err, path, "is damaged")
    for main in (lambda: sample.main(["--out-dir", str(run_copy), "--max-new-tokens", "2"]),
                 lambda: evalpy.main(["--out-dir", str(run_copy), "--examples", "4", "--max-batches", "1"]),
                 lambda: _export(["export", str(run_copy), str(tmp_path / "hf")])):
        assert main() == 2
        one_line_error(capsys.readouterr().err, path, "is damaged")
    assert not os.path.exists(tmp_path / "hf")


DAMAGED_MANIFEST_TEXTS = {   # manifest.json bytes that are no manifest
    "not UTF-8": (b'{"format": 2, "step": "\xff\xfe"}', "unreadable (UnicodeDecodeError)"),   # was a traceback
    "nested too deep": (b"[" * 100_000, "unreadable (RecursionError)"),                     # was a traceback
    "truncated": (b'{"format": 2, "st', "unreadable (JSONDecodeError)"),
    "format a string": (b'{"format": "2"}', "has format '2', this nanohlat reads 2"),
    "a list": (b"[2]", "has format None"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED_MANIFEST_TEXTS))
def test_a_manifest_that_is_not_json_is_one_line_on_resume_sample_eval_and_export(case, run_copy, cache_dir,
                                                                                   capsys, tmp_path):
    import eval as evalpy
    import sample
    text, message = DAMAGED_MANIFEST_TEXTS[case]
    path = os.path.join(ckpt(run_copy, 4), "manifest.json")
    with open(path, "wb") as f:
        f.write(text)
    code, err = main_in_process(flags(cache_dir, run_copy, "--steps", 6, "--resume", "auto"), capsys)
    assert code == 2
    one_line_error(err, path, message)
    for main in (lambda: sample.main(["--out-dir", str(run_copy), "--max-new-tokens", "2"]),
                 lambda: evalpy.main(["--out-dir", str(run_copy), "--examples", "4", "--max-batches", "1"]),
                 lambda: _export(["export", str(run_copy), str(tmp_path / "hf")])):
        assert main() == 2
        one_line_error(capsys.readouterr().err, path, message)


def test_a_manifest_without_zero1_resumes_from_its_zero_stage(run_copy, cache_dir, capsys):
    """"zero1" is only for older readers: with "zero" present its absence is no damage (it was a KeyError)."""
    path = os.path.join(ckpt(run_copy, 4), "manifest.json")
    with open(path) as f:
        m = json.load(f)
    m["layout"].pop("zero1")
    with open(path, "w") as f:
        json.dump(m, f)
    code, err = main_in_process(flags(cache_dir, run_copy, "--steps", 6, "--resume", "auto"), capsys)
    assert code == 0, err


HUGE_ROTARY = dict(max_seq_len=2**24, d_model=4096, n_heads=2, n_kv_heads=2)   # rotary tables of 256 GiB
DAMAGED_CONFIGS = {   # manifest["config"] fields that pass read_manifest: refused before a model is built
    "2^24 positions at head dim 2048": (lambda m: m["config"]["model"].update(**HUGE_ROTARY),
                                        "this model does not fit: it needs about"),
    "max_seq_len 10^12": (lambda m: m["config"]["model"].update(max_seq_len=10**12),
                          "config.model: --max-seq-len 1,000,000,000,000 is more than 2^24"),
    "seq_len 0": (lambda m: m["config"]["train"].update(seq_len=0), "config.train: --seq-len must be positive"),
    "seq_len abc": (lambda m: m["config"]["train"].update(seq_len="abc"), "config.train.seq_len is 'abc'"),
    "seq_len -5": (lambda m: m["config"]["train"].update(seq_len=-5), "--seq-len must be positive, got -5"),
    "lr nan": (lambda m: m["config"]["train"].update(lr=float("nan")), "config.train.lr is nan"),
    "zero 1.5": (lambda m: m["config"]["train"].update(zero=1.5), "config.train.zero is 1.5"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED_CONFIGS))
def test_a_damaged_config_is_one_line_in_every_command_that_builds_its_model(case, run_copy, tmp_path, capsys):
    """sample.py, eval.py, the HF export and speculative decoding: one line naming the
    checkpoint, exit 2, before the model is built (2^24 positions at head dim 2048: 256 GiB
    of rotary tables), and no export folder left behind."""
    import eval as evalpy
    import sample
    from nanohlat.serving import server
    edit, message = DAMAGED_CONFIGS[case]
    _edit_manifest(run_copy, 4, edit)
    for main in (lambda: sample.main(["--out-dir", str(run_copy), "--max-new-tokens", "2"]),
                 lambda: evalpy.main(["--out-dir", str(run_copy), "--examples", "4", "--max-batches", "1"]),
                 lambda: _export(["export", str(run_copy), str(tmp_path / "hf")]),
                 lambda: server.main(["--target", str(run_copy), "--draft", str(run_copy), "--max-new-tokens", "2"])):
        assert main() == 2
        one_line_error(capsys.readouterr().err, ckpt(run_copy, 4), message)
    assert not (tmp_path / "hf").exists() and not (run_copy / "eval.json").exists()


def test_the_cheap_checks_come_before_the_shards_are_hashed(run_copy, capsys):
    """A model too big for this machine and a corrupt shard: the size, known from the
    manifest alone, is what sample.py says, before reading every shard's bytes for its sha256."""
    import sample
    _edit_manifest(run_copy, 4, lambda m: m["config"]["model"].update(**HUGE_ROTARY))
    shard = os.path.join(ckpt(run_copy, 4), "shard_00000.pt")
    with open(shard, "r+b") as f:   # same size, other bytes: only the hash can tell
        f.seek(100)
        f.write(b"\0" * 16)
    assert sample.main(["--out-dir", str(run_copy), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    one_line_error(err, "this model does not fit", ckpt(run_copy, 4))
    assert "sha256" not in err, err


def test_hf_import_of_a_model_too_big_for_this_machine_is_refused_before_reading_it(base, tmp_path, capsys):
    """The size comes from config.json, checked before any weight is read."""
    from nanohlat.serving import hf
    assert _export(["export", str(base), str(tmp_path / "hf")]) == 0
    config = tmp_path / "hf" / "config.json"
    cfg = json.loads(config.read_text())
    cfg.update(hidden_size=2**20, intermediate_size=2**20, head_dim=2**20 // cfg["num_attention_heads"])
    config.write_text(json.dumps(cfg))
    capsys.readouterr()
    assert _export(["import", str(tmp_path / "hf"), str(tmp_path / "run")]) == 2
    one_line_error(capsys.readouterr().err, "this model does not fit", str(config))
    assert not (tmp_path / "run").exists()
    assert hf.from_hf_config(cfg).d_model == 2**20


DAMAGED_HF_CONFIGS = {   # an HF model's config.json: each field nanohlat reads, damaged
    "num_attention_heads 0": ({"num_attention_heads": 0}, "--n-heads must be positive, got 0"),   # ZeroDivisionError
    "hidden_size true": ({"hidden_size": True}, "no integer 'hidden_size' (got True)"),
    "num_key_value_heads abc": ({"num_key_value_heads": "abc"}, "num_key_value_heads is 'abc', not a whole number"),
    "max_position_embeddings 1.5": ({"max_position_embeddings": 1.5}, "max_position_embeddings is 1.5"),
    "rms_norm_eps NaN": ({"rms_norm_eps": float("nan")}, "rms_norm_eps is nan, not a finite number"),
    "rms_norm_eps 0": ({"rms_norm_eps": 0}, "--norm-eps must be a finite number > 0, got 0"),  # was the default
    "rope_theta abc": ({"rope_theta": "abc", "rope_parameters": None}, "rope_theta is 'abc'"),
    "rope_parameters' rope_theta a list": ({"rope_parameters": {"rope_theta": []}}, "rope_theta is [], not a number"),
    "rope_scaling abc": ({"rope_scaling": "abc"}, "rope_scaling is 'abc', not a record or null"),   # AttributeError
    "architectures 5": ({"architectures": 5, "model_type": None}, "architectures is 5"),          # TypeError
    "tie_word_embeddings yes": ({"tie_word_embeddings": "yes"}, "tie_word_embeddings is 'yes'"),
    "head_dim abc": ({"head_dim": "abc"}, "head_dim is 'abc', not a whole number"),
}


@pytest.fixture(scope="module")
def hf_dir(base, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "model"
    assert _export(["export", str(base), str(out)]) == 0
    return out


@pytest.mark.parametrize("case", sorted(DAMAGED_HF_CONFIGS))
def test_a_damaged_hf_config_is_one_line_and_imports_nothing(case, hf_dir, tmp_path, capsys):
    import shutil
    edit, message = DAMAGED_HF_CONFIGS[case]
    model = tmp_path / "model"
    shutil.copytree(hf_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(edit)
    (model / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert _export(["import", str(model), str(tmp_path / "run")]) == 2
    one_line_error(capsys.readouterr().err, str(model / "config.json"), message)
    assert not (tmp_path / "run").exists()


def test_a_non_utf8_metrics_file_counts_as_a_run_record(tmp_path):
    """An untrained run's leftovers are removed only when metrics.jsonl is empty; a damaged,
    non-UTF-8 one was a UnicodeDecodeError there."""
    from nanohlat.run import runlock
    (tmp_path / "metrics.jsonl").write_bytes(b"\xff\xfe\n")
    runlock.forget_untrained_run(str(tmp_path))
    assert (tmp_path / "metrics.jsonl").exists()


def test_damaged_metrics_lines_are_dropped_with_a_note_on_resume(run_copy, cache_dir, capsys):
    path = run_copy / "metrics.jsonl"
    good = path.read_bytes()
    # ({"loss": 1.0}: a record without a step was kept as step 0)
    path.write_bytes(good + b'{"step": 3, "loss": \xff\xfe}\n[1, 2]\n{"step": "x"}\n{"step": null}\n'
                            b'{"loss": 1.0}\n{"step": 3, "los')
    code, err = main_in_process(flags(cache_dir, run_copy, "--steps", 6, "--resume", "auto"), capsys)
    assert code == 0 and "Traceback" not in err, err
    assert f"note: {path}" in err and "6 damaged line(s)" in err, err
    assert sorted(losses(run_copy)) == [1, 2, 3, 4, 5, 6]


# ---------------------------------------------------------------------------
# Non-finite numbers: refused models, strict JSON
# ---------------------------------------------------------------------------

def test_a_checkpoint_with_a_nan_weight_is_refused_by_every_command_that_uses_it(base, tmp_path, capsys):
    """eval.py scored it (val_loss nan beside an accuracy) and the HF export wrote it:
    now they, like sample.py and speculative decoding, refuse it in sample.py's line."""
    import eval as evalpy
    import sample
    from nanohlat import device
    from nanohlat.run import checkpoint
    from nanohlat.serving import server
    from nanohlat.serving.generate import load_model   # the loader of every command
    model, manifest = load_model(str(base), device.get_device("cpu"))
    state = model.state_dict()
    state["layers.1.mlp.up.weight"][3, 5] = float("nan")
    bad = tmp_path / "nan"
    checkpoint.save_full(str(bad), model.cfg, state, manifest["tokenizer"])
    line = "has non-finite weights (NaN or inf) in layers.1.mlp.up.weight: it cannot be sampled, evaluated or exported"
    for main in (lambda: sample.main(["--out-dir", str(bad), "--max-new-tokens", "2"]),
                 lambda: evalpy.main(["--out-dir", str(bad), "--examples", "4", "--max-batches", "1"]),
                 lambda: _export(["export", str(bad), str(tmp_path / "hf")]),
                 lambda: server.main(["--target", str(bad), "--draft", str(bad), "--max-new-tokens", "2"])):
        assert main() == 2
        one_line_error(capsys.readouterr().err, str(bad), line)
    assert not (tmp_path / "hf").exists() and not (bad / "eval.json").exists()


def _strict(text: str):
    def reject(constant):
        raise ValueError(f"not strict JSON: {constant}")
    return json.loads(text, parse_constant=reject)


def test_every_json_file_is_strict_after_lr_1e30(tmp_path, cache_dir, capsys):
    """--lr 1e30: the gradient norms of the steps after the first are NaN. metrics.jsonl
    (each line), summary.json, config.json and eval.json parse as strict JSON; a
    non-finite number is the string "NaN" / "Infinity" / "-Infinity"."""
    import eval as evalpy
    out = tmp_path / "run"
    code, err = main_in_process(flags(cache_dir, out, "--lr", "1e30", "--min-lr", 0, "--max-bad-steps", 0,
                                      "--eval-every", 2, "--eval-batches", 1), capsys)
    assert code == 0, err
    rows = [_strict(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["grad_norm"] for r in rows if "grad_norm" in r][1:] == ["NaN"] * 3, rows
    assert float(rows[1]["grad_norm"]) != float(rows[1]["grad_norm"])      # float() reads it back: nan
    for name in ("summary.json", "config.json"):
        _strict((out / name).read_text())
    assert evalpy.main(["--out-dir", str(out), "--examples", "4", "--max-batches", "1"]) == 0
    _strict((out / "eval.json").read_text())
    evalpy.write_json(str(tmp_path / "e.json"), {"val_loss": float("inf"), "x": [float("-inf"), float("nan")]})
    assert _strict((tmp_path / "e.json").read_text()) == {"val_loss": "Infinity", "x": ["-Infinity", "NaN"]}


# ---------------------------------------------------------------------------
# Messages that name the right thing
# ---------------------------------------------------------------------------

def test_nproc_under_a_launcher_of_another_world_size_is_refused(base, cache_dir, tmp_path, capsys, monkeypatch):
    import sample
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    code, err = main_in_process(flags(cache_dir, tmp_path / "run", "--nproc", 2), capsys)
    assert code == 2
    one_line_error(err, "--nproc 2", "WORLD_SIZE=1")
    assert not (tmp_path / "run").exists()
    assert sample.main(["--out-dir", str(base), "--nproc", "2"]) == 2
    one_line_error(capsys.readouterr().err, "--nproc 2", "WORLD_SIZE=1")


def test_sample_and_eval_say_when_the_newest_checkpoint_has_no_manifest(run_copy, capsys):
    import eval as evalpy
    import sample
    os.remove(os.path.join(ckpt(run_copy, 4), "manifest.json"))
    assert sample.main(["--out-dir", str(run_copy), "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert f"the newest checkpoint {ckpt(run_copy, 4)} has no manifest.json" in err and ckpt(run_copy, 2) in err
    assert evalpy.main(["--out-dir", str(run_copy), "--examples", "4", "--max-batches", "1"]) == 0
    assert f"the newest checkpoint {ckpt(run_copy, 4)} has no manifest.json" in capsys.readouterr().err


def test_a_folder_given_as_tokenizer_is_named_a_folder(tmp_path, cache_dir, capsys):
    code, err = main_in_process(flags(cache_dir, tmp_path / "run", "--tokenizer", tmp_path), capsys)
    assert code == 2
    one_line_error(err, "is a folder", "tokenizer.model")


def test_corrupt_shard_messages_suggest_flags_the_reader_has(run_copy, capsys):
    import sample
    shard = os.path.join(ckpt(run_copy, 4), "shard_00000.pt")
    with open(shard, "r+b") as f:
        f.seek(100)
        f.write(b"\0" * 8)
    assert sample.main(["--out-dir", str(run_copy), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    one_line_error(err, shard, "sample.py or eval.py --checkpoint PATH")


def test_a_signal_under_sample_nproc_does_not_suggest_resume(tmp_path, capsys):
    import signal
    import types
    from nanohlat.run import launch
    failures = {0: types.SimpleNamespace(exitcode=128 + signal.SIGINT)}
    assert launch._report_failures(failures, str(tmp_path), stop_hint="") == 130
    err = capsys.readouterr().err
    assert err.strip() == "stopped by a signal", err
    launch._report_failures(failures, str(tmp_path))
    assert "--resume auto" in capsys.readouterr().err     # train.py's workers saved a checkpoint


def test_max_new_tokens_beyond_the_context_says_where_it_stops(base, capsys):
    import sample
    assert sample.main(["--out-dir", str(base), "--prompt", "def ", "--max-new-tokens", "500", "--seed", "0"]) == 0
    err = capsys.readouterr().err
    assert "note: the model's context is 64 tokens" in err and "not --max-new-tokens 500" in err, err
