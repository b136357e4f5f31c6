"""nanohlat/run/data.py: tokenizer, cache, packing and batches, as specifications.

Most tests use a small synthetic Python corpus written here (a tokenizer for
it trains in well under a second); one test touches the built-in stdlib corpus.
"""

import json
import multiprocessing as mp
import os
import random

import numpy as np
import pytest
import torch

from nanohlat.config import UserError
from nanohlat.run.data import (Dataset, builtin_corpus_files, load_tokenizer, prepare_data,
                           read_documents)

VOCAB = 512   # the `tiny` preset's vocabulary

# Things a code tokenizer must give back exactly: indentation, blank lines,
# trailing spaces, tabs, \r, non-ASCII (byte fallback), and a lone U+FFFD.
SOURCE = (
    "class Point:\n"
    "    \"\"\"A point — in ℝ².\"\"\"\n"
    "\n\n"
    "    def __init__(self, x=0, y=0):   \n"
    "\tif x:\n"
    "\t\tself.x = x  # tabs, 😀, 日本語\r\n"
    "        return None\n"
    "\n"
    "x = '\\n' + \"\\t\" + 'ünïcödé \ufffd'\n"
    "   \n"
)


def write_corpus(root, n_files=24):
    """Deterministic Python-looking files, half of them in a sub-package, plus files to skip."""
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "value", "count", "total", "index",
             "name", "items", "result", "buffer", "offset", "length", "größe"]
    paths = []
    for i in range(n_files):
        lines = [f'"""Module {i}: helpers for {rng.choice(words)}."""', "", "import os", ""]
        for j in range(25):
            a, b = rng.sample(words, 2)
            lines += [f"def {a}_{b}_{j}({a}, {b}=None):",
                      f'    """Return the {a} of {b}."""',
                      f"    if {b} is None:",
                      f"        {b} = {rng.randint(0, 9999)}",
                      f"    for i in range({b}):",
                      f"        {a} += i * {j}",
                      f"    return {a}", "", ""]
        folder = root / ("pkg/sub" if i % 2 else "")
        folder.mkdir(parents=True, exist_ok=True)
        paths.append(folder / f"mod{i:02d}.py")
        paths[-1].write_text("\n".join(lines), encoding="utf-8")
    (root / "README.md").write_text("# Synthetic corpus\n\nUsed by tests.\n")
    (root / "data.bin").write_bytes(b"\x00\x01 not text")          # wrong suffix: skipped
    (root / ".git").mkdir()
    (root / ".git" / "HEAD.txt").write_text("hidden folder: skipped")
    (root / "empty.txt").write_text("")                              # empty: no document
    return root


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    return str(write_corpus(tmp_path_factory.mktemp("corpus")))


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def dataset(corpus, cache) -> Dataset:
    return prepare_data(corpus, "", VOCAB, cache_dir=cache, log=lambda msg: None)


def test_folder_documents_are_the_text_files_sorted(corpus):
    docs = read_documents(corpus)
    assert len(docs) == 24 + 1                                        # .py files + README.md
    assert docs[0].startswith("# Synthetic corpus")                   # README.md sorts first
    assert not any("hidden folder" in d or "not text" in d for d in docs)


def test_tokenizer_round_trips_python_source(dataset):
    tok = dataset.tokenizer
    assert tok.vocab_size == VOCAB and tok.bos_id >= 0 and tok.eos_id >= 0
    ids = tok.encode(SOURCE)
    assert tok.bos_id not in ids and tok.eos_id not in ids            # encode adds no BOS/EOS
    assert tok.decode(ids) == SOURCE
    assert tok.decode(torch.tensor(ids)) == SOURCE                    # tensors decode too
    for doc in read_documents(__file__):                              # real code: this file
        assert tok.decode(tok.encode(doc)) == doc
    assert load_tokenizer(tok.path).encode(SOURCE) == ids


def test_second_prepare_reuses_the_cache(corpus, tmp_path):
    first, second = [], []
    a = prepare_data(corpus, "", VOCAB, cache_dir=str(tmp_path), log=first.append)
    mtime = os.stat(a.tokenizer.path).st_mtime_ns
    b = prepare_data(corpus, "", VOCAB, cache_dir=str(tmp_path), log=second.append)
    assert any("training" in m for m in first) and any("tokenised" in m for m in first)
    assert not any("training" in m or "tokenised" in m for m in second)
    assert os.stat(b.tokenizer.path).st_mtime_ns == mtime
    assert np.array_equal(a.train, b.train) and a.val_documents == b.val_documents


def test_incomplete_cache_entry_is_rebuilt(corpus, tmp_path):
    a = prepare_data(corpus, "", VOCAB, cache_dir=str(tmp_path), log=lambda m: None)
    os.remove(os.path.join(a.directory, "meta.json"))                 # as if a build died before the manifest
    log = []
    b = prepare_data(corpus, "", VOCAB, cache_dir=str(tmp_path), log=log.append)
    assert any("tokenised" in m for m in log)
    assert np.array_equal(a.train, b.train)


def test_same_inputs_give_the_same_tokens_in_any_cache(corpus, dataset, tmp_path):
    other = prepare_data(corpus, "", VOCAB, cache_dir=str(tmp_path), log=lambda m: None)
    with open(other.tokenizer.path, "rb") as f, open(dataset.tokenizer.path, "rb") as g:
        assert f.read() == g.read()
    assert np.array_equal(other.train, dataset.train) and np.array_equal(other.val, dataset.val)


def test_packing_bos_doc_eos_and_overlapping_windows(corpus, dataset):
    tok, train = dataset.tokenizer, np.asarray(dataset.train)
    assert isinstance(dataset.train, np.memmap) and train.dtype == np.uint16
    assert train[0] == tok.bos_id and train[-1] == tok.eos_id
    eos = np.flatnonzero(train == tok.eos_id)
    assert np.all(train[eos[:-1] + 1] == tok.bos_id)                  # ... doc EOS BOS doc ...
    # Train and val documents together are exactly the corpus; val ~2%, at least one.
    docs = read_documents(corpus)
    assert 1 <= len(dataset.val_documents) < len(docs) // 2
    train_docs = [tok.decode(train[s + 1:e]) for s, e in zip(np.r_[0, eos[:-1] + 1], eos)]
    assert sorted(train_docs + dataset.val_documents) == sorted(docs)
    assert tok.decode(dataset.val) == "".join(dataset.val_documents)
    assert dataset.bytes_per_token("val") == pytest.approx(
        sum(len(d.encode()) for d in dataset.val_documents) / len(dataset.val))
    # Window i is train[i*T : i*T + T + 1]; neighbours share one token; every batch row is a window.
    T = 16
    n = dataset.num_windows("train", T)
    assert n == (len(train) - 1) // T
    windows = np.lib.stride_tricks.sliding_window_view(train, T + 1)[::T][:n]   # (n, T+1)
    assert np.array_equal(windows[:-1, -1], windows[1:, 0])
    rows = dataset.batch(step=3, batch_size=8, seq_len=T, seed=0).numpy()
    assert all((windows == row).all(axis=1).any() for row in rows)


def test_batches_depend_only_on_seed_step_split(dataset, corpus, cache):
    x = dataset.batch(step=5, batch_size=6, seq_len=32, seed=1337)
    assert x.shape == (6, 33) and x.dtype == torch.int64
    again = prepare_data(corpus, "", VOCAB, cache_dir=cache, log=lambda m: None)   # e.g. another rank
    assert torch.equal(x, again.batch(step=5, batch_size=6, seq_len=32, seed=1337))
    assert not torch.equal(x, dataset.batch(step=6, batch_size=6, seq_len=32, seed=1337))
    assert not torch.equal(x, dataset.batch(step=5, batch_size=6, seq_len=32, seed=1338))
    v = dataset.batch(step=5, batch_size=6, seq_len=32, seed=1337, split="val")
    assert v.shape == (6, 33) and not torch.equal(x, v)


def test_jsonl_with_existing_tokenizer(dataset, tmp_path):
    texts = [f"def f{i}(x):\n    return x * {i}\n" * (40 + i) for i in range(5)]
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)) + "\n")
    assert read_documents(str(path)) == texts
    # An existing tokenizer sets the vocabulary: the vocab_size argument is ignored.
    ds = prepare_data(str(path), dataset.tokenizer.path, 99999, cache_dir=str(tmp_path / "c"), log=lambda m: None)
    assert ds.tokenizer.vocab_size == VOCAB
    # Fewer than 20 documents: val is the tail of the text, cut at a line start.
    tok = ds.tokenizer
    assert tok.decode(ds.train) + "".join(ds.val_documents) == "".join(texts)
    assert tok.decode(ds.train).endswith("\n") and ds.val[0] == tok.bos_id


def test_concurrent_prepare_builds_once(corpus, tmp_path):
    ctx = mp.get_context("fork")   # fork: no re-import, so the test stays fast
    queue = ctx.Queue()

    def worker():
        log = []
        ds = prepare_data(corpus, "", VOCAB, cache_dir=str(tmp_path), log=log.append)
        queue.put((ds.directory, any("training" in m for m in log), int(ds.train.sum())))

    procs = [ctx.Process(target=worker) for _ in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len({r[0] for r in results}) == 1 and len({r[2] for r in results}) == 1
    assert sum(r[1] for r in results) == 1                            # exactly one process trained


def test_user_errors(corpus, dataset, tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read_documents(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no text"):
        prepare_data(str(tmp_path / "empty"), "", VOCAB, cache_dir=str(tmp_path / "c"), log=lambda m: None)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n\n{"text": 3}\n')
    with pytest.raises(UserError, match=r"bad\.jsonl:3:"):
        read_documents(str(bad))
    bad.write_text('{"text": "ok"}\n{"text": "unterminated\n')
    with pytest.raises(UserError, match=r"bad\.jsonl:2:"):
        read_documents(str(bad))
    with pytest.raises(UserError, match="--tokenizer"):
        load_tokenizer(str(tmp_path / "missing.model"))
    with pytest.raises(UserError, match="not a readable SentencePiece model"):
        load_tokenizer(str(bad))
    (tmp_path / "small.txt").write_text("x = 1\n" * 100)
    with pytest.raises(UserError, match="--vocab-size 4096 is too large for this corpus"):
        prepare_data(str(tmp_path / "small.txt"), "", 4096, cache_dir=str(tmp_path / "c"), log=lambda m: None)
    n_val = len(dataset.val)
    with pytest.raises(UserError, match=f"val split has {n_val} tokens.*--seq-len"):
        dataset.batch(step=0, batch_size=2, seq_len=n_val, seed=0, split="val")


def test_builtin_corpus_is_the_stdlib(tmp_path):
    files = builtin_corpus_files()
    assert len(files) > 100 and files == sorted(files)
    skipped = {"site-packages", "test", "tests", "idlelib", "lib2to3", "ensurepip", "turtledemo", "__pycache__"}
    assert not any(skipped & set(f.split(os.sep)) for f in files)
    assert any(f.endswith(os.sep + "os.py") for f in files)
    ds = prepare_data("", "", VOCAB, cache_dir=str(tmp_path), log=lambda m: None)
    assert ds.num_windows("val", 256) > 10 and 1.5 < ds.bytes_per_token() < 3
    assert ds.tokenizer.decode(ds.val) == "".join(ds.val_documents)


# ---------------------------------------------------------------------------
# A damaged token cache is never trained on (issue 25)
# ---------------------------------------------------------------------------

def old_sample_hash(path: str, blocks: int = 64, block: int = 4096) -> str:
    """The previous version's cache check, kept here to show what it missed: the
    file's size and `blocks` evenly spaced blocks (a small file hashed whole)."""
    import hashlib
    size = os.path.getsize(path)
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    with open(path, "rb") as f:
        if size <= blocks * block:
            h.update(f.read())
        else:
            for i in range(blocks):
                f.seek(i * (size - block) // (blocks - 1))
                h.update(f.read(block))
    return h.hexdigest()


def unsampled_ranges(size: int, blocks: int = 64, block: int = 4096) -> list[tuple[int, int]]:
    """The byte ranges of a file that the old check (old_sample_hash) never read."""
    starts = [i * (size - block) // (blocks - 1) for i in range(blocks)]
    return [(a + block, b) for a, b in zip(starts, starts[1:]) if b > a + block]


def zero_a_third_unsampled(path: str) -> None:
    size, done = os.path.getsize(path), 0
    with open(path, "r+b") as f:
        for a, b in unsampled_ranges(size):
            f.seek(a)
            f.write(bytes(b - a))
            done += b - a
            if done >= size // 3:
                return
    raise AssertionError("the file is too small to zero a third of it outside the sampled blocks")


def put_token(path: str, dtype: str, value: int) -> None:
    """One token id written in the middle of an unsampled range."""
    a, b = unsampled_ranges(os.path.getsize(path))[10]
    itemsize = np.dtype(dtype).itemsize
    with open(path, "r+b") as f:
        f.seek((a + b) // 2 // itemsize * itemsize)
        f.write(np.array([value], dtype=dtype).tobytes())


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A corpus whose train.bin (~1 MB) is large enough to be sampled, not hashed whole, by the old check."""
    corpus = str(write_corpus(tmp_path_factory.mktemp("big"), n_files=400))
    cache = str(tmp_path_factory.mktemp("bigcache"))
    return corpus, cache, prepare_data(corpus, "", VOCAB, cache_dir=cache, log=lambda m: None)


@pytest.mark.parametrize("damage", ["zeros", "token id = vocab", "token id = 65535", "old-format meta.json"])
def test_a_damaged_cache_is_rebuilt_with_one_note(damage, big, tmp_path):
    import shutil
    corpus, cache, good = big
    cache = shutil.copytree(cache, tmp_path / "cache")
    train_bin = os.path.join(cache, os.path.basename(good.directory), "train.bin")
    meta_path = os.path.join(os.path.dirname(train_bin), "meta.json")
    old = old_sample_hash(train_bin)
    if damage == "zeros":
        zero_a_third_unsampled(train_bin)
    elif damage == "old-format meta.json":   # as the previous version wrote it: sampled hashes only
        meta = json.load(open(meta_path))
        for split in meta["splits"].values():
            split["sample_hash"] = split.pop("sha256")
        meta["val_documents_hash"] = meta.pop("val_documents_sha256")
        open(meta_path, "w").write(json.dumps(meta))
    else:
        put_token(train_bin, good.meta["dtype"], int(damage.split()[-1].replace("vocab", str(VOCAB))))
    assert old_sample_hash(train_bin) == old                                # what the old check would have seen
    with pytest.raises(UserError, match="damaged"):                     # a reopened one (a worker): refused
        Dataset(good.tokenizer, os.path.dirname(train_bin))
    notes = []
    again = prepare_data(corpus, "", VOCAB, cache_dir=str(cache), log=notes.append)
    rebuilt = [n for n in notes if "rebuilding" in n]
    assert len(rebuilt) == 1 and "\n" not in rebuilt[0], notes
    assert ("older nanohlat" if damage.startswith("old") else "damaged") in rebuilt[0]
    assert np.array_equal(again.train, good.train) and np.array_equal(again.val, good.val)
    notes.clear()
    prepare_data(corpus, "", VOCAB, cache_dir=str(cache), log=notes.append)   # once: now it is whole
    assert not any("rebuilding" in n for n in notes), notes


def test_the_range_check_catches_what_the_hash_cannot(big, tmp_path):
    """An out-of-range id under a matching hash (a build gone wrong, a hand-edited meta.json)."""
    import shutil
    from nanohlat.run.data import verify_shards
    from nanohlat.system.files import sha256_file
    corpus, cache, good = big
    entry = shutil.copytree(good.directory, tmp_path / "entry")
    put_token(str(entry / "train.bin"), good.meta["dtype"], VOCAB)
    meta = json.load(open(entry / "meta.json"))
    meta["splits"]["train"]["sha256"] = sha256_file(str(entry / "train.bin"))
    (entry / "meta.json").write_text(json.dumps(meta))
    assert verify_shards(str(entry), VOCAB) == f"train.bin holds token id {VOCAB}, outside the vocabulary of {VOCAB}"
    with pytest.raises(UserError, match="outside the vocabulary"):
        Dataset(good.tokenizer, str(entry))


def test_a_link_at_a_cache_name_is_not_followed(big, tmp_path):
    import shutil
    corpus, cache, good = big
    cache = shutil.copytree(cache, tmp_path / "cache")
    victim = tmp_path / "victim"
    victim.write_bytes(b"mine")
    entry = os.path.join(cache, os.path.basename(good.directory))
    os.remove(os.path.join(entry, "train.bin"))
    os.symlink(victim, os.path.join(entry, "train.bin"))               # a link inside the entry
    again = prepare_data(corpus, "", VOCAB, cache_dir=str(cache), log=lambda m: None)
    assert victim.read_bytes() == b"mine" and not os.path.islink(os.path.join(entry, "train.bin"))
    assert np.array_equal(again.train, good.train)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_bytes(b"mine")
    shutil.rmtree(entry)
    os.symlink(elsewhere, entry)                                       # a link at the entry's name
    again = prepare_data(corpus, "", VOCAB, cache_dir=str(cache), log=lambda m: None)
    assert os.listdir(elsewhere) == ["keep"] and (elsewhere / "keep").read_bytes() == b"mine"
    assert not os.path.islink(entry) and np.array_equal(again.train, good.train)


def test_training_on_a_damaged_builtin_cache_gives_the_undamaged_losses(cache_dir, tmp_path, capsys):
    """The issue's case: a third of the stdlib train.bin zeroed outside the sampled blocks, then train.py."""
    import glob
    import shutil
    import train
    from conftest import read_metrics
    copy = shutil.copytree(cache_dir, tmp_path / "cache")              # the session cache stays read-only
    zero_a_third_unsampled(glob.glob(os.path.join(copy, "tokens-*", "train.bin"))[0])
    losses = []
    for cache, out in ((cache_dir, tmp_path / "good"), (copy, tmp_path / "damaged")):
        assert train.main(["--preset", "tiny", "--steps", "3", "--eval-every", "0", "--no-progress", "--threads", "1",
                           "--cache-dir", str(cache), "--out-dir", str(out)]) == 0
        losses.append([m["loss"] for m in read_metrics(str(out))])
    out = capsys.readouterr().out
    assert out.count("rebuilding them") == 1 and "damaged (train.bin does not match its hash" in out
    assert losses[0] == losses[1] and len(losses[0]) == 3


def test_a_cached_tokenizer_that_no_longer_loads_is_trained_again(corpus, dataset, tmp_path):
    import shutil
    root = os.path.dirname(os.path.dirname(dataset.tokenizer.path))   # <cache>/tokenizer-<key>/tokenizer.model
    cache = shutil.copytree(root, tmp_path / "cache")
    model = os.path.join(cache, os.path.relpath(dataset.tokenizer.path, root))
    with open(model, "wb") as f:
        f.write(b"not a model")
    notes = []
    again = prepare_data(corpus, "", VOCAB, cache_dir=str(cache), log=notes.append)
    assert sum("is damaged; training it again" in n for n in notes) == 1, notes
    assert np.array_equal(again.train, dataset.train)
