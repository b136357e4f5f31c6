"""Evaluation: held-out metrics, multiple-choice scoring, the built-in task,
task files, the eval.py CLI and the lm-evaluation-harness adapter, each
checked against a computation done here by hand."""

import importlib.util
import json
import math
import os
import sys
import sysconfig

import pytest
import torch

from nanohlat.serving import evaluate
from nanohlat.config import UserError
from nanohlat.recipe import ModelConfig
from nanohlat.run.data import prepare_data
from nanohlat.model import Transformer, init_weights
from nanohlat.run.build import decoder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STDLIB = sysconfig.get_paths()["stdlib"]
MODULES = ["textwrap.py", "string.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "heapq.py",
           "calendar.py", "difflib.py", "fractions.py", "statistics.py", "argparse.py"]


def read(name: str) -> str:
    with open(os.path.join(STDLIB, name), encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """One ~500 KB file of Python, a 500-piece tokenizer (padded to 512 in the model), token shards."""
    tmp = tmp_path_factory.mktemp("corpus")
    path = tmp / "code.py"
    path.write_text("\n".join(read(m) for m in MODULES), encoding="utf-8")
    ds = prepare_data(str(path), "", 500, str(tmp / "cache"), log=lambda *a: None)
    return ds, str(path), str(tmp / "cache")


def tiny_model(vocab_size: int, seed: int = 0, max_seq_len: int = 128, experts: int = 0) -> Transformer:
    """Two layers; `experts` > 0: both are a mixture of that many experts, top-2 (moe.py)."""
    cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=vocab_size,
                      max_seq_len=max_seq_len, moe_experts=experts)
    model = decoder(cfg)
    init_weights(model, seed)
    return model.eval()


def direct_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t+1] | ids[:t+1]) for every t, one unpadded sequence, padded vocabulary excluded."""
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]))[0, :, :model.cfg.vocab_size]
    return torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)


# ---------------------------------------------------------------------------
# Held-out metrics
# ---------------------------------------------------------------------------

def test_bits_per_byte_of_a_uniform_model_is_log2_vocab_times_tokens_per_byte(corpus):
    """With a zero head every logit is 0: p = 1/V for each of the V real tokens (the
    padded ones masked), so the loss is ln V exactly and bits/byte = log2 V * tokens / bytes,
    counted here from the held-out text itself (each document packed as BOS text EOS)."""
    ds, _, _ = corpus
    tok = ds.tokenizer
    model = tiny_model(tok.vocab_size)
    assert model.cfg.padded_vocab == 512 > tok.vocab_size == 500
    with torch.no_grad():
        model.head.weight.zero_()
    tokens = sum(len(tok.encode(d)) + 2 for d in ds.val_documents)
    n_bytes = sum(len(d.encode("utf-8")) for d in ds.val_documents)
    m = evaluate.heldout_metrics(model, ds, seq_len=64, batch_size=8, max_batches=2)
    assert m["val_loss"] == pytest.approx(math.log(500), rel=1e-6)
    assert m["perplexity"] == pytest.approx(500, rel=1e-5)
    assert m["bits_per_byte"] == pytest.approx(math.log2(500) * tokens / n_bytes, rel=1e-6)
    assert m["tokens_scored"] == 2 * 8 * 64


@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "moe"])
def test_heldout_metrics_match_a_window_by_window_computation(corpus, experts):
    ds, _, _ = corpus
    model = tiny_model(ds.tokenizer.vocab_size, seed=3, experts=experts)
    seq_len = 64
    m = evaluate.heldout_metrics(model, ds, seq_len, batch_size=5, max_batches=0)   # every window
    n_windows = (len(ds.val) - 1) // seq_len
    windows = torch.tensor([ds.val[i * seq_len:(i + 1) * seq_len + 1].tolist() for i in range(n_windows)])
    with torch.no_grad():
        logits = model(windows[:, :-1])[..., :model.cfg.vocab_size].double()       # (N, T, V) real vocab only
    nats = -torch.log_softmax(logits, -1).gather(-1, windows[:, 1:, None]).sum().item()
    loss = nats / (n_windows * seq_len)
    assert m["tokens_scored"] == n_windows * seq_len
    assert m["val_loss"] == pytest.approx(loss, rel=1e-5)
    assert m["bits_per_byte"] == pytest.approx(loss / math.log(2) / ds.bytes_per_token("val"), rel=1e-5)
    # A subset is spread over the whole split, first window to last, and is the same every call.
    starts = evaluate.heldout_windows(len(ds.val), seq_len, 10)
    assert starts[0] == 0 and starts[-1] == (n_windows - 1) * seq_len and len(set(starts)) == 10
    assert evaluate.heldout_metrics(model, ds, seq_len, 5, 2) == evaluate.heldout_metrics(model, ds, seq_len, 5, 2)


# ---------------------------------------------------------------------------
# Multiple choice
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "moe"])
def test_choice_scores_are_summed_token_logprobs_given_the_context(corpus, experts):
    """(A mixture of experts too: right-padding rows in a batch changes no real token's routing.)"""
    ds, _, _ = corpus
    tok = ds.tokenizer
    model = tiny_model(tok.vocab_size, seed=1, max_seq_len=48, experts=experts)
    cases = [("def add(a, b):\n", "    return a + b"), ("def add(a, b):\n", "    pass"),
             ("x = ", "[1, 2, 3]"), ("", "import os"),          # empty context: conditioned on BOS only
             ("# " + "long comment " * 20 + "\n", "y = 1")]   # longer than max_seq_len: cut from the left
    pairs = [evaluate.encode_pair(tok, c, x) for c, x in cases]
    for (c, x), (ctx, cont) in zip(cases, pairs):
        assert ctx[0] == tok.bos_id and tok.decode(ctx[1:]) + tok.decode(cont) == c + x
    got = evaluate.score_continuations(model, pairs, batch_size=3)    # mixed lengths, right-padded
    for (ctx, cont), (logp, greedy) in zip(pairs, got):
        full = (ctx + cont)[-(48 + 1):]
        want = direct_logprobs(model, full)[-len(cont):]
        assert logp == pytest.approx(want.sum().item(), abs=1e-4)
        assert greedy is False       # a random model does not predict this code
    assert len(pairs[-1][0]) + len(pairs[-1][1]) > 49    # the truncation case really truncates

    # acc / acc_norm are the argmax of these sums, raw and per UTF-8 byte of the choice.
    task = evaluate.Task("t", [evaluate.Example("def add(a, b):\n", ["    return a + b", "    pass"], 0),
                               evaluate.Example("x = ", ["[1, 2, 3]", "1", "'é'"], 2)])
    res = evaluate.evaluate_task(model, tok, task, batch_size=2)
    hits, hits_norm = [], []
    for ex in task.examples:
        s = [l for l, _ in evaluate.score_continuations(model, [evaluate.encode_pair(tok, ex.context, c)
                                                                 for c in ex.choices])]
        hits.append(max(range(len(s)), key=lambda k: s[k]) == ex.label)
        per_byte = [s[k] / len(ex.choices[k].encode()) for k in range(len(s))]
        hits_norm.append(max(range(len(s)), key=lambda k: per_byte[k]) == ex.label)
    assert res["acc"] == sum(hits) / 2 and res["acc_norm"] == sum(hits_norm) / 2
    assert res["chance"] == pytest.approx((1 / 2 + 1 / 3) / 2)


def test_fewshot_prompts_are_solved_examples_separated_by_blank_lines():
    task = evaluate.Task("t", [evaluate.Example(f"q{i}:", [f" a{i}", " no"], 0) for i in range(10)])
    p = evaluate.fewshot_context(task, 4, shots=3, seed=7)
    demos = p.split("\n\n")
    assert len(demos) == 4 and demos[-1] == "q4:" and all(d.endswith(f"q{d[1]}: a{d[1]}"[-3:]) for d in demos[:3])
    assert "q4: a4" not in p                                   # never its own answer
    assert p == evaluate.fewshot_context(task, 4, shots=3, seed=7) != evaluate.fewshot_context(task, 4, 3, 8)
    with pytest.raises(UserError, match="--shots"):
        evaluate.fewshot_context(task, 0, shots=10, seed=0)


# ---------------------------------------------------------------------------
# The built-in next-line task
# ---------------------------------------------------------------------------

def test_next_line_task_is_deterministic_and_well_formed():
    docs = [read(m) for m in MODULES[:6]]
    a, b = evaluate.next_line_task(docs, 50, seed=1), evaluate.next_line_task(docs, 50, seed=1)
    assert a == b and a != evaluate.next_line_task(docs, 50, seed=2) and len(a.examples) == 50
    for ex in a.examples:
        assert len(ex.choices) == 4 == len(set(ex.choices))
        assert all(len(c.strip()) >= 8 for c in ex.choices)
        true = ex.choices[ex.label]
        assert any(ex.context + true + "\n" in d or d.endswith(ex.context + true) for d in docs)
    assert len({ex.label for ex in a.examples}) == 4            # the answer is not always in one place


def test_builtin_task_accuracy_of_a_random_model_is_chance(corpus):
    """True lines and distractors are drawn from the same pool of lines, so for a
    scorer that ignores the context each example is right with probability 1/4,
    whatever it prefers (short lines, long lines), up to a negligible tilt from
    requiring four different texts. A random model is such a
    scorer up to noise. Over n = 400 independent examples the accuracy is then
    Binomial(400, 1/4) / 400: standard deviation sqrt(.25 * .75 / 400) = 0.022;
    we allow 4 of them (|acc - 0.25| <= 0.087), which a chance scorer exceeds
    with probability ~6e-5, while a trained model is far above it (see the report)."""
    ds, _, _ = corpus
    docs = [read(m) for m in MODULES]
    task = evaluate.next_line_task(docs, 400, seed=0)
    model = tiny_model(ds.tokenizer.vocab_size, seed=5)
    res = evaluate.evaluate_task(model, ds.tokenizer, task, batch_size=32)
    tol = 4 * math.sqrt(0.25 * 0.75 / 400)
    assert res["chance"] == 0.25 and res["examples"] == 400
    assert abs(res["acc"] - 0.25) <= tol and abs(res["acc_norm"] - 0.25) <= tol, res


# ---------------------------------------------------------------------------
# Task files
# ---------------------------------------------------------------------------

def test_task_files_load_and_bad_ones_name_file_and_line(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"context": "1 + 1 =", "choices": [" 2", " 3"], "label": 0}\n\n'
                    '{"context": "2 + 2 =", "choices": [" 3", " 4", " 5"], "label": 1}\n')
    task = evaluate.load_task_file(str(good))
    assert task.name == "good" and [e.label for e in task.examples] == [0, 1]
    with pytest.raises(UserError, match="does not exist"):
        evaluate.load_task_file(str(tmp_path / "missing.jsonl"))
    for body, what in [('{"context": "a", "choices": ["b", "c"], "label": 0}\n{"context": "a", "choices"\n', "JSON"),
                       ('{"context": "a", "choices": ["b", "c"], "label": 0}\n{"context": "a", "label": 0}\n',
                        "choices"),
                       ('{"context": "a", "choices": ["b", "c"], "label": 0}\n{"context": "a", "choices": ["b"], '
                        '"label": 0}\n', "at least 2"),
                       ('{"context": "a", "choices": ["b", "c"], "label": 0}\n{"context": "a", "choices": ["b", "c"], '
                        '"label": 2}\n', "label"),
                       ('{"context": "a", "choices": ["b", "c"], "label": 0}\n{"context": 1, "choices": ["b", "c"], '
                        '"label": true}\n', "context")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(body)
        with pytest.raises(UserError, match=f"bad.jsonl:2: .*{what}"):
            evaluate.load_task_file(str(bad))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(UserError, match="no examples"):
        evaluate.load_task_file(str(tmp_path / "empty.jsonl"))


# ---------------------------------------------------------------------------
# eval.py
# ---------------------------------------------------------------------------

def load_cli():
    spec = importlib.util.spec_from_file_location("nanohlat_eval_cli", os.path.join(ROOT, "eval.py"))
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


def test_cli_rejects_bad_input_with_one_line_and_exit_2(tmp_path, capsys):
    cli = load_cli()
    for argv in (["--task", str(tmp_path / "nope.jsonl")], ["--shots", "-1"],
                 ["--out-dir", str(tmp_path), "--all-checkpoints"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err


def test_cli_evaluates_every_checkpoint_of_a_run(corpus, tmp_path, capsys):
    checkpoint = pytest.importorskip("nanohlat.run.checkpoint")
    if not hasattr(checkpoint, "save_full"):
        pytest.skip("nanohlat.run.checkpoint.save_full not written yet")
    ds, data_path, cache_dir = corpus
    run = str(tmp_path / "run")
    for step, seed in ((0, 0), (10, 1)):
        model = tiny_model(ds.tokenizer.vocab_size, seed=seed)
        path = checkpoint.save_full(run, model.cfg, model.state_dict(), ds.tokenizer.path, step=step, tokens=step * 100)
        # What train.py records: where the data is, so eval finds the same held-out split.
        with open(os.path.join(path, "manifest.json")) as f:
            manifest = json.load(f)
        manifest["config"]["train"] = {"data": data_path, "cache_dir": cache_dir, "seq_len": 64}
        with open(os.path.join(path, "manifest.json"), "w") as f:
            json.dump(manifest, f)
    task = tmp_path / "arith.jsonl"
    task.write_text("".join(json.dumps({"context": f"{i} + {i} =", "choices": [f" {2 * i}", f" {2 * i + 1}"],
                                        "label": 0}) + "\n" for i in range(6)))
    cli = load_cli()
    argv = ["--out-dir", run, "--all-checkpoints", "--task", "builtin", str(task), "--examples", "40",
            "--max-batches", "2", "--batch-size", "8", "--shots", "1", "--device", "cpu"]
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    assert "next_line acc" in table and "arith acc_norm" in table and len(table.strip().splitlines()) == 3
    with open(os.path.join(run, "eval.json")) as f:
        out = json.load(f)
    rows = out["results"]
    assert [(r["step"], r["tokens"]) for r in rows] == [(0, 0), (10, 1000)]
    assert set(rows[0]["tasks"]) == {"next_line", "arith"} and rows[0]["tasks"]["arith"]["examples"] == 6
    assert rows[0]["val_loss"] != rows[1]["val_loss"] and rows[0]["tokens_scored"] == 2 * 8 * 64
    # One checkpoint: the latest, by default, as a readable summary.
    assert cli.main(["--out-dir", run, "--max-batches", "1", "--examples", "20", "--json",
                     str(tmp_path / "one.json")]) == 0
    assert "next_line" in capsys.readouterr().out
    with open(tmp_path / "one.json") as f:
        assert json.load(f)["results"][0]["step"] == 10


def test_cli_evaluates_a_mixture_of_experts_checkpoint(corpus, tmp_path, capsys):
    """eval.py on a MoE checkpoint: the held-out figures it writes are the ones
    heldout_metrics gives on the model loaded here, and the built-in task runs."""
    from nanohlat.device import get_device
    from nanohlat.run import checkpoint
    from nanohlat.serving.generate import load_model
    ds, data_path, cache_dir = corpus
    model = tiny_model(ds.tokenizer.vocab_size, seed=2, experts=4)
    path = checkpoint.save_full(str(tmp_path / "run"), model.cfg, model.state_dict(), ds.tokenizer.path, step=3)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["config"]["train"] = {"data": data_path, "cache_dir": cache_dir, "seq_len": 64}
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    out = str(tmp_path / "eval.json")
    assert load_cli().main(["--out-dir", str(tmp_path / "run"), "--max-batches", "2", "--batch-size", "8",
                            "--examples", "20", "--device", "cpu", "--json", out]) == 0
    assert "next_line" in capsys.readouterr().out
    with open(out) as f:
        row = json.load(f)["results"][0]
    loaded, _ = load_model(path, get_device("cpu"))
    assert loaded.cfg.moe_experts == 4
    want = evaluate.heldout_metrics(loaded, ds, 64, batch_size=8, max_batches=2)
    assert row["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6) and row["tokens_scored"] == 2 * 8 * 64
    assert row["tasks"]["next_line"]["examples"] == 20


# ---------------------------------------------------------------------------
# lm-evaluation-harness adapter (optional dependency)
# ---------------------------------------------------------------------------

# lm_eval (~80 packages) is in the `harness` extra, not in `test`; CI installs both.
NEEDS_LM_EVAL = 'needs the lm-evaluation-harness: pip install -e ".[harness]"'

def test_lm_eval_harness_task_from_a_local_file_matches_our_scoring(corpus, tmp_path, monkeypatch):
    """A harness multiple-choice task defined by a config dict over a local JSONL
    file (no download) gives the same acc / acc_norm as evaluate_task, and the
    adapter's rolling and generation requests agree with direct computations."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")      # prove it needs no network
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm_eval = pytest.importorskip("lm_eval", reason=NEEDS_LM_EVAL)
    from lm_eval.api.instance import Instance
    from lm_eval.tasks import TaskManager
    from nanohlat.serving.harness import NanoHLATLM

    ds, _, _ = corpus
    tok = ds.tokenizer
    model = tiny_model(tok.vocab_size, seed=2)
    task = evaluate.next_line_task([read(m) for m in MODULES[:4]], 24, seed=3)
    data = tmp_path / "next_line.jsonl"
    data.write_text("".join(json.dumps({"context": e.context, "choices": e.choices, "label": e.label}) + "\n"
                            for e in task.examples))
    config = {"task": "nanohlat_next_line", "dataset_path": "json",
              "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(tmp_path / "hf_cache")},
              "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{context}}",
              "doc_to_choice": "{{choices}}", "doc_to_target": "{{label}}", "target_delimiter": "",
              "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}
    lm = NanoHLATLM(model=model, tokenizer=tok, batch_size=8)
    out = lm_eval.simple_evaluate(model=lm, tasks=[config], task_manager=TaskManager(include_defaults=False),
                                  num_fewshot=0, bootstrap_iters=0, log_samples=False)
    theirs = out["results"]["nanohlat_next_line"]
    ours = evaluate.evaluate_task(model, tok, task)
    assert theirs["acc,none"] == ours["acc"] and theirs["acc_norm,none"] == ours["acc_norm"]

    # loglikelihood_rolling: a short text is one window, [BOS] text, every token scored.
    text = read("bisect.py")[:200]
    ids = [tok.bos_id] + tok.encode(text)
    [rolling] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert rolling == pytest.approx(direct_logprobs(model, ids).sum().item(), abs=1e-4)
    # generate_until: greedy, stops at the stop string, never returns it.
    [gen] = lm.generate_until([Instance("generate_until", {}, ("def f(x):\n", {"until": ["\n"], "max_gen_toks": 8}), 0)])
    assert isinstance(gen, str) and "\n" not in gen


@pytest.mark.slow
def test_harness_command_line_bad_path_is_one_line_on_any_machine(tmp_path, monkeypatch, capsys):
    """`python -m nanohlat.harness` without --device runs where nanohlat's auto
    device says (the harness's own default is cuda:0), and a path= without a
    run is one line, exit 2, like every nanohlat command."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pytest.importorskip("lm_eval", reason=NEEDS_LM_EVAL)
    from nanohlat.serving import harness
    monkeypatch.setattr(sys, "argv", ["harness", "--model", "nanohlat", "--model_args",
                                      f"path={tmp_path / 'none'}", "--tasks", "arc_easy"])
    assert harness.main() == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: no complete checkpoint in") and "Traceback" not in err, err
