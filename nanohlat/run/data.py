"""Data: corpus -> tokenizer -> packed token shards -> fixed-shape batches.

    files ──read_documents──> documents ──SentencePiece BPE──> token ids
                                                                  │ pack
    train.bin / val.bin (np.memmap):  BOS doc EOS BOS doc EOS BOS doc EOS ...
                                      |--- window 0 ---|
                                                       |--- window 1 ---|
                                      each window is seq_len + 1 tokens; neighbours
                                      share one token, so every token is a target once

The default corpus is the Python standard library of the interpreter running
us: real text, on every machine, no download (docs/design.md section 6). It is code, so the
tokenizer must keep indentation and newlines exactly: decode(encode(s)) == s.

Everything expensive happens once and is cached under --cache-dir, keyed by
what it depends on (corpus identity, vocab size or tokenizer file, and
FORMAT_VERSION). Several ranks may call prepare_data at once: a file lock lets
the first build while the others wait, and a cache entry becomes visible only
by an atomic rename after its manifest is written, so a crash mid-build never
leaves something that later loads.

Every cache entry is checked when it is opened: each shard's size and its
full SHA-256 against meta.json, and every token id below the vocabulary size
(verify_shards). Reading it all is cheap: the built-in corpus's shards are
7-11 MB (the `default` preset's cache and tiny's), hashed in 10-30 ms and
range-checked in 1-3 ms (measured on a 2-core machine). A damaged entry is
rebuilt with a one-line note (or, if it cannot be, refused with a one-line
error), never trained on: a byte changed anywhere changes the hash, and a bad
id never reaches the device.

Batches are drawn by window index from an RNG seeded by (seed, step, split)
only, so the global batch of a step is the same under every parallel layout;
each data-parallel rank then takes its slice of it (docs/design.md 5.2).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import io
import itertools
import json
import os
import re
import shutil
import sysconfig
import time

import numpy as np
import sentencepiece as spm
import torch
from tqdm import tqdm

from nanohlat.config import UserError
from nanohlat.system.files import atomic_write, sha256_file

FORMAT_VERSION = 1                    # bump when the cache layout or packing changes
TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst", ".json")
JSONL_SUFFIXES = (".jsonl", ".jsonlines")
BUILTIN_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib",
                     "lib2to3", "ensurepip", "turtledemo", "__pycache__"}
TOKENIZER_TRAIN_CHARS = 16_000_000    # sample bound: the stdlib (~11M chars) fits whole, in ~2 s
CHUNK_CHARS = 4000                    # SentencePiece "sentence" size during training
VAL_ONE_IN = 50                       # hold out ~2% of documents ...
MIN_DOCS_FOR_DOC_SPLIT = 20           # ... when there are at least this many
MIN_VAL_CHARS = 16_384                # else the last 5% of the text, at least this much
ENCODE_BATCH = 256                    # documents per call into SentencePiece's threaded encoder
SPLIT_CODES = {"train": 0, "val": 1}  # third word of the batch RNG seed
OLD_CACHE = "built by an older nanohlat, without full checksums"   # (they had sampled hashes only)


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------

class Tokenizer:
    """A SentencePiece model. encode() adds no BOS/EOS: packing adds them.

    decode(encode(s)) == s for any text except one that contains "▁" (U+2581)
    itself: SentencePiece uses that character for a space and decodes it as one.
    """

    def __init__(self, path: str):
        self.path = path
        self.sp = spm.SentencePieceProcessor(model_file=path)
        self.vocab_size = self.sp.get_piece_size()
        self.bos_id = self.sp.bos_id()
        self.eos_id = self.sp.eos_id()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids) -> str:
        # ids may be a list, a numpy array or a tensor; BOS/EOS decode to "".
        return self.sp.decode(ids.tolist() if hasattr(ids, "tolist") else [int(i) for i in ids])


def load_tokenizer(path: str) -> Tokenizer:
    if os.path.isdir(path):
        raise UserError(f"--tokenizer {path!r} is a folder; give the SentencePiece tokenizer.model file "
                        f"inside it (e.g. {os.path.join(path, 'tokenizer.model')!r})")
    if not os.path.isfile(path):
        raise UserError(f"--tokenizer {path!r} does not exist; give a SentencePiece tokenizer.model file "
                        f"or leave --tokenizer empty to train one on --data")
    try:
        tok = Tokenizer(path)
    except (RuntimeError, OSError) as e:
        raise UserError(f"--tokenizer {path!r} is not a readable SentencePiece model ({e}); "
                        f"give a tokenizer.model file") from None
    if tok.bos_id < 0 or tok.eos_id < 0:  # packing needs both (LLaMA's has bos=1, eos=2)
        raise UserError(f"--tokenizer {path!r} has no BOS or EOS token (bos={tok.bos_id}, eos={tok.eos_id}); "
                        f"use a tokenizer that defines both")
    return tok


def _doc_chunks(doc: str):
    """Cut a document into pieces of at most CHUNK_CHARS, ending at a line end where possible.

    SentencePiece trains on "sentences" and drops any longer than
    max_sentence_length; feeding it whole multi-line chunks (instead of
    lines, as its file reader would) is what lets "\\n" and runs of
    indentation become pieces such as ":\\n" and "▁▁▁▁▁▁▁▁".
    """
    start = 0
    while start < len(doc):
        end = min(start + CHUNK_CHARS, len(doc))
        if end < len(doc):
            nl = doc.rfind("\n", start, end)
            end = nl + 1 if nl > start else end   # one huge line (minified JSON): cut mid-line
        yield doc[start:end]
        start = end


def _train_tokenizer(docs: list[str], vocab_size: int, path: str, log) -> None:
    total = sum(map(len, docs))
    # Bound the training text by keeping every stride-th chunk: an even, deterministic
    # sample of the whole corpus (SentencePiece's own sampler is random and unseeded).
    stride = max(1, -(-total // TOKENIZER_TRAIN_CHARS))
    chunks = (c for k, c in enumerate(itertools.chain.from_iterable(map(_doc_chunks, docs))) if k % stride == 0)
    log(f"data: training a {vocab_size}-piece SentencePiece BPE tokenizer on {total // stride:,} characters")
    t0, model = time.time(), io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=chunks, model_writer=model, model_type="bpe", vocab_size=vocab_size,
            byte_fallback=True,                       # any unseen character -> its UTF-8 bytes, never <unk>
            normalization_rule_name="identity",       # no NFKC: code must come back byte for byte
            remove_extra_whitespaces=False,           # indentation is syntax
            add_dummy_prefix=False,                   # no invented leading space per document
            allow_whitespace_only_pieces=True,        # "▁▁▁▁" (one indent level) becomes one token
            split_digits=True,                        # numbers as digits, as LLaMA does
            input_sentence_size=0, shuffle_input_sentence=False,  # we sampled above, deterministically
            max_sentence_length=4 * CHUNK_CHARS,      # bytes: a chunk of 4-byte characters still fits
            num_threads=2,                            # fixed: it is recorded in the model file's bytes
            minloglevel=2)                            # silence the trainer's progress chatter
    except RuntimeError as e:
        most, least = re.search(r"value <= (\d+)", str(e)), re.search(r"required_chars.* vs (\d+)", str(e))
        if most:
            raise UserError(f"--vocab-size {vocab_size} is too large for this corpus: it supports at most "
                            f"{most.group(1)} pieces; use a smaller --vocab-size or more --data") from None
        if least:
            raise UserError(f"--vocab-size {vocab_size} is too small for this corpus: its characters and the 256 "
                            f"byte pieces need at least {least.group(1)}; use a larger --vocab-size") from None
        raise UserError(f"SentencePiece could not train a tokenizer with --vocab-size {vocab_size} ({e}); "
                        f"try a different --vocab-size (at least ~300: 256 byte pieces are reserved)") from None
    atomic_write(path, lambda f: f.write(model.getvalue()))
    log(f"data: tokenizer trained in {time.time() - t0:.1f}s -> {path}")


# ---------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------

def default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "nanohlat")


def _walk(root: str, skip_dirs=(), suffixes=TEXT_SUFFIXES + JSONL_SUFFIXES) -> list[str]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning dirnames in place stops os.walk descending; hidden folders (.git) are never data.
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
        files += [os.path.join(dirpath, f) for f in filenames if f.endswith(suffixes)]
    return sorted(files)


def builtin_corpus_files() -> list[str]:
    """The .py sources of this interpreter's standard library, minus tests and installed packages."""
    return _walk(sysconfig.get_paths()["stdlib"], BUILTIN_SKIP_DIRS, (".py",))


def _read_text(path: str) -> str:
    # errors="replace": one stray latin-1 byte in a folder of thousands of files should
    # not stop a run (it shows up as U+FFFD). Universal newlines turn \r\n into \n.
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _read_jsonl(path: str) -> list[str]:
    docs = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
                if not isinstance(text, str):
                    raise TypeError(f"'text' is a {type(text).__name__}")
            except (ValueError, KeyError, TypeError) as e:
                raise UserError(f"{path}:{lineno}: not a JSON object with a \"text\" string ({type(e).__name__}: {e}); "
                                f"each line of a .jsonl file must look like {{\"text\": \"...\"}}") from None
            # JSON may spell lone surrogates ("\ud800"), which are not encodable text: make them "?".
            docs.append(text.encode("utf-8", "replace").decode("utf-8"))
    return docs


def _data_files(data: str) -> list[str]:
    if data == "":
        return builtin_corpus_files()
    if not os.path.exists(data):
        raise UserError(f"--data {data!r} does not exist; give a text file, a .jsonl file or a folder, "
                        f"or leave --data empty for the built-in corpus")
    files = _walk(data) if os.path.isdir(data) else [data]
    for path in files:   # a FIFO or device (/dev/zero) would hang or never end; a broken link cannot be read
        if not os.path.isfile(path):
            what = "a broken symbolic link" if os.path.islink(path) and not os.path.exists(path) else \
                "not a regular file (a pipe, device or socket)"
            raise UserError(f"--data {path!r} is {what}; give regular text files")
    return files


def read_documents(data: str) -> list[str]:
    """data "" -> the built-in corpus; a file -> one document (.jsonl: one per line, its "text");
    a folder -> every .txt/.py/.md/.rst/.json (and .jsonl) file inside, recursively, sorted."""
    docs = []
    for path in _data_files(data):
        docs += _read_jsonl(path) if path.endswith(JSONL_SUFFIXES) else [_read_text(path)]
    docs = [d for d in docs if d]   # an empty document would only add "BOS EOS"
    if not docs:
        raise UserError(f"--data {data!r} holds no text (looked for {', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES)} "
                        f"files); point it at non-empty text, or leave it empty for the built-in corpus")
    return docs


def _corpus_identity(data: str) -> list:
    """What the cache key of a corpus is made of: cheap to compute, changes when the corpus does."""
    files = _data_files(data)
    if len(files) == 1 and data:   # one file: hash its content, so a copy elsewhere still hits the cache
        return ["file", files[0].endswith(JSONL_SUFFIXES), sha256_file(files[0])]
    # A folder (or the stdlib): paths, sizes and mtimes, so a warm start reads no text at all.
    stats = [(os.path.abspath(p), os.stat(p)) for p in files]
    return ["files"] + [[p, st.st_size, st.st_mtime_ns] for p, st in stats]


def _split_documents(docs: list[str]) -> tuple[list[str], list[str]]:
    """Deterministic held-out split: returns (train documents, val documents).

    >= 20 documents: a document is held out when the hash of its text is 0 mod
    50 (~2%, at least one). Hashing the text, not the position, keeps the split
    stable when files are added, and puts duplicate documents on the same side.
    Fewer documents: the last 5% of the text (at least MIN_VAL_CHARS, at most a
    quarter), cut at a line start, so val keeps the "BOS doc EOS" format too.
    """
    if len(docs) >= MIN_DOCS_FOR_DOC_SPLIT:
        keys = [int.from_bytes(hashlib.sha256(d.encode()).digest()[:8], "little") for d in docs]
        held = {i for i, k in enumerate(keys) if k % VAL_ONE_IN == 0} or {int(np.argmin(keys))}
        return ([d for i, d in enumerate(docs) if i not in held], [d for i, d in enumerate(docs) if i in held])
    total = sum(map(len, docs))
    want = max(1, total // 20, min(MIN_VAL_CHARS, total // 4))
    train, val = list(docs), []
    while train and want > 0:
        last = train.pop()
        if len(last) <= want:          # the whole document goes to val
            val.insert(0, last)
            want -= len(last)
            continue
        cut = last.rfind("\n", 0, len(last) - want) + 1 or len(last) - want
        train.append(last[:cut])
        val.insert(0, last[cut:])
        break
    return train, val


# ---------------------------------------------------------------------------
# The cache: locking, atomic writes, building the token shards
# ---------------------------------------------------------------------------

def _key(*parts) -> str:
    return hashlib.sha256(json.dumps([FORMAT_VERSION, *parts]).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _locked(cache_dir: str, log):
    """Exclusive lock over the cache dir, so concurrent ranks build once. The OS drops
    an flock when its process dies, so a crashed builder never blocks the next run."""
    with open(os.path.join(cache_dir, "lock"), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"data: waiting for another process building the cache in {cache_dir}")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_shards(docs: list[str], tok: Tokenizer, out_dir: str, corpus_key: str, log) -> None:
    train_docs, val_docs = _split_documents(docs)
    dtype = np.uint16 if tok.vocab_size <= 65535 else np.uint32   # halves the memmap for every real vocab
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    for stale in glob.glob(f"{out_dir}.tmp-*"):   # left by a builder that crashed (we hold the lock)
        shutil.rmtree(stale, ignore_errors=True)
    os.makedirs(tmp)
    meta = {"format": FORMAT_VERSION, "tokenizer": tok.path, "vocab_size": tok.vocab_size,
            "dtype": np.dtype(dtype).name, "corpus": corpus_key, "splits": {}}
    t0 = time.time()
    bar = tqdm(total=len(docs), desc="tokenising", unit="doc", disable=None, leave=False)  # None: only on a tty
    for split, split_docs in (("train", train_docs), ("val", val_docs)):
        n_tokens = 0
        with open(os.path.join(tmp, f"{split}.bin"), "wb") as f:
            # Stream batch by batch: a list of Python ints costs ~36 bytes a token, the shard 2.
            for i in range(0, len(split_docs), ENCODE_BATCH):
                batch = split_docs[i:i + ENCODE_BATCH]
                encoded = tok.sp.encode(batch, num_threads=os.cpu_count() or 1)
                packed = np.fromiter(itertools.chain.from_iterable([tok.bos_id, *ids, tok.eos_id] for ids in encoded),
                                     dtype=dtype)
                f.write(packed.tobytes())
                n_tokens += len(packed)
                bar.update(len(batch))
            f.flush()
            os.fsync(f.fileno())
        # Bytes per token converts the loss to bits per byte, a number comparable across tokenizers.
        # Token counts include BOS/EOS because the loss averages over those targets too.
        n_bytes = sum(len(d.encode("utf-8")) for d in split_docs)
        meta["splits"][split] = {"documents": len(split_docs), "tokens": n_tokens, "bytes": n_bytes,
                                 "sha256": sha256_file(os.path.join(tmp, f"{split}.bin"))}
    bar.close()
    atomic_write(os.path.join(tmp, "val_documents.json"), lambda f: f.write(json.dumps(val_docs).encode()))
    meta["val_documents_sha256"] = sha256_file(os.path.join(tmp, "val_documents.json"))
    atomic_write(os.path.join(tmp, "meta.json"), lambda f: f.write(json.dumps(meta, indent=1).encode()))   # last: marks "complete"
    if os.path.islink(out_dir):   # a link planted at the entry's name is removed, never followed
        os.remove(out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)   # debris or a damaged entry (we hold the lock; links inside unfollowed)
    os.rename(tmp, out_dir)   # the entry appears whole, or not at all
    s = meta["splits"]
    log(f"data: tokenised {len(docs)} documents in {time.time() - t0:.1f}s: "
        f"train {s['train']['tokens']:,} tokens ({s['train']['documents']} docs), "
        f"val {s['val']['tokens']:,} tokens ({s['val']['documents']} docs) -> {out_dir}")


def prepare_data(data: str, tokenizer: str, vocab_size: int, cache_dir: str = "", log=print) -> "Dataset":
    """Tokenizer + token shards for --data, built once and then loaded from cache_dir.

    tokenizer "" trains a BPE tokenizer of vocab_size pieces on the corpus; a path
    loads that tokenizer and ignores vocab_size (the model must use tok.vocab_size).
    A build reads the whole corpus into memory once; later calls read only the shards.
    """
    cache_dir = cache_dir or default_cache_dir()
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as e:
        raise UserError(f"--cache-dir {cache_dir!r} cannot be created ({e}); choose a writable folder") from None
    corpus = _corpus_identity(data)
    try:
        with _locked(cache_dir, log):
            return _prepare_locked(data, tokenizer, vocab_size, cache_dir, corpus, log)
    except OSError as e:   # a read-only or full cache dir: rebuilding is impossible
        raise UserError(f"the data cache in {cache_dir!r} cannot be built ({e.strerror}: {e.filename}); "
                        f"free space or give a writable --cache-dir") from None


def _prepare_locked(data: str, tokenizer: str, vocab_size: int, cache_dir: str, corpus: list, log) -> "Dataset":
    docs = None   # read lazily: a warm cache never touches the corpus text
    if tokenizer:
        tok_path = tokenizer
    else:
        tok_dir = os.path.join(cache_dir, f"tokenizer-{_key(corpus, vocab_size)}")
        tok_path = os.path.join(tok_dir, "tokenizer.model")
        if os.path.exists(tok_path):
            try:
                load_tokenizer(tok_path)
            except UserError:
                log(f"data: the cached tokenizer {tok_path} is damaged; training it again")
                os.remove(tok_path)
        if not os.path.exists(tok_path):
            docs = read_documents(data)
            os.makedirs(tok_dir, exist_ok=True)
            _train_tokenizer(docs, vocab_size, tok_path, log)
    tok = load_tokenizer(tok_path)
    shard_dir = os.path.join(cache_dir, f"tokens-{_key(corpus, sha256_file(tok_path))}")
    damage = verify_shards(shard_dir, tok.vocab_size) if os.path.exists(os.path.join(shard_dir, "meta.json")) \
        else "missing"
    if damage is None:
        log(f"data: using cached tokens in {shard_dir}")
    else:
        if damage == OLD_CACHE:   # once: the rebuilt entry has them
            log(f"data: the cached tokens in {shard_dir} were {damage}; rebuilding them")
        elif damage != "missing":
            log(f"data: the cached tokens in {shard_dir} are damaged ({damage}); rebuilding them")
        _build_shards(docs if docs is not None else read_documents(data), tok, shard_dir, _key(corpus), log)
        damage = verify_shards(shard_dir, tok.vocab_size)
        if damage:   # only a build that went wrong: never train on it
            raise UserError(f"the token cache {shard_dir} was rebuilt but is still damaged ({damage}); "
                            f"remove it or give another --cache-dir")
    return Dataset(tok, shard_dir, verified=True)


def verify_shards(directory: str, vocab_size: int | None = None) -> str | None:
    """What is wrong with a token cache entry (None: nothing): meta.json readable
    and complete, of this vocabulary (None: the one it records), every file of its
    recorded size and SHA-256, and every token id in [0, vocab_size) (unsigned, so >= 0)."""
    try:
        with open(os.path.join(directory, "meta.json")) as f:
            meta = json.load(f)
        dtype = np.dtype(meta["dtype"])
        checks = [(f"{split}.bin", meta["splits"][split]["tokens"] * dtype.itemsize, meta["splits"][split]["sha256"])
                  for split in SPLIT_CODES]
        checks.append(("val_documents.json", None, meta["val_documents_sha256"]))
        meta["corpus"]
        vocab_size = meta["vocab_size"] if vocab_size is None else vocab_size
        if meta["vocab_size"] != vocab_size or dtype not in (np.uint16, np.uint32):
            return f"meta.json records vocabulary {meta['vocab_size']} as {dtype}, the tokenizer has {vocab_size}"
    except KeyError as e:
        if e.args and e.args[0] in ("sha256", "val_documents_sha256"):
            return OLD_CACHE
        return f"meta.json has no {e} record (an older nanohlat's cache, or a damaged one)"
    except (OSError, ValueError, TypeError) as e:
        return f"meta.json is unreadable ({e.__class__.__name__})"
    for name, size, digest in checks:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if size is not None and os.path.getsize(path) != size:
            return f"{name} has {os.path.getsize(path):,} bytes, meta.json says {size:,}"
        if sha256_file(path) != digest:
            return f"{name} does not match its hash (SHA-256) in meta.json"
        if name.endswith(".bin") and size:
            # Whole-shard, vectorised: a bad id would otherwise end in a cross-entropy error mid-run.
            top = int(np.memmap(path, dtype=dtype, mode="r").max())
            if top >= vocab_size:
                return f"{name} holds token id {top}, outside the vocabulary of {vocab_size}"
    return None


# ---------------------------------------------------------------------------
# The dataset: memmapped shards and layout-independent batches
# ---------------------------------------------------------------------------

class Dataset:
    def __init__(self, tokenizer: Tokenizer, directory: str, verified: bool = False):
        self.tokenizer = tokenizer
        self.directory = directory
        # prepare_data has just verified (or rebuilt) the entry. A reopened one (a worker of
        # --nproc N) checks it again but never rebuilds: N workers would race to; the pre-flight did it.
        damage = None if verified else verify_shards(directory, tokenizer.vocab_size)
        if damage:
            raise UserError(f"the token cache {directory} is damaged ({damage}); run again to rebuild it")
        with open(os.path.join(directory, "meta.json")) as f:
            self.meta = json.load(f)
        self.fingerprint = self.meta["corpus"]   # which corpus the tokens are of (checkpoints record it)
        with open(os.path.join(directory, "val_documents.json"), encoding="utf-8") as f:
            self.val_documents: list[str] = json.load(f)
        # memmap: the OS pages tokens in on demand and shares them between ranks on one machine.
        self.train = self._open(os.path.join(directory, "train.bin"))
        self.val = self._open(os.path.join(directory, "val.bin"))

    def __reduce__(self):
        # Sent to another process (train.py --nproc hands its workers the dataset it
        # prepared) as its two paths: the receiver maps the same files, no token is copied.
        return _reopen, (self.tokenizer.path, self.directory)

    def _open(self, path: str) -> np.ndarray:
        dtype = np.dtype(self.meta["dtype"])
        if os.path.getsize(path) == 0:   # mmap refuses empty files
            return np.zeros(0, dtype)
        return np.memmap(path, dtype=dtype, mode="r")

    def _tokens(self, split: str) -> np.ndarray:
        if split not in SPLIT_CODES:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        return self.train if split == "train" else self.val

    def num_windows(self, split: str, seq_len: int) -> int:
        # Window i needs tokens up to index i*seq_len + seq_len, so i <= (N - 1 - seq_len) / seq_len.
        return max(0, (len(self._tokens(split)) - 1) // seq_len)

    def batch(self, step: int, batch_size: int, seq_len: int, seed: int, split: str = "train") -> torch.Tensor:
        """The whole global batch of `step`: int64 (batch_size, seq_len + 1); inputs [:, :-1], targets [:, 1:].

        Depends only on (seed, step, split, batch_size, seq_len): never on rank or layout,
        so every layout trains on the same tokens and a resumed run on the same ones again.
        """
        tokens = self._tokens(split)
        n = self.num_windows(split, seq_len)
        if n < 1:
            raise UserError(f"the {split} split has {len(tokens)} tokens, fewer than one window of --seq-len "
                            f"{seq_len} + 1; use a smaller --seq-len or more --data")
        if seed < 0 or step < 0:   # numpy seeds are non-negative words
            raise UserError(f"--seed and the step must be >= 0, got seed {seed}, step {step}")
        # A fresh generator per step (not one advanced step by step) lets a resumed run,
        # or an eval at any step, draw its batch without replaying the ones before.
        rng = np.random.default_rng([seed, step, SPLIT_CODES[split]])
        starts = rng.integers(0, n, size=batch_size) * seq_len                        # (B,)
        index = starts[:, None] + np.arange(seq_len + 1)                               # (B, T+1)
        return torch.from_numpy(tokens[index].astype(np.int64))                        # (B, T+1)

    def bytes_per_token(self, split: str = "val") -> float:
        self._tokens(split)   # validates the name
        s = self.meta["splits"][split]
        return s["bytes"] / max(1, s["tokens"])


def _reopen(tokenizer_path: str, directory: str) -> Dataset:
    return Dataset(load_tokenizer(tokenizer_path), directory)
