"""Serving: batched and tensor-parallel generation, the schedulers, speculative decoding.

Greedy decoding compares argmaxes, so a test is only meaningful when the
top-2 logits are further apart than round-off: the models here have their
matrices scaled up (`_model`), and `_margin` checks that they are.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from nanohlat.serving import generate as gen
from nanohlat.serving import server as serving
from nanohlat.config import UserError
from nanohlat.recipe import PRESETS
from nanohlat.model import Transformer, init_weights
from nanohlat.run.build import decoder

CFG = PRESETS["tiny"][0]                                  # 8 heads, 4 kv heads (GQA), vocab 512
MOE_CFG = PRESETS["moe"][0]                               # tiny's shape, 4 experts top-2 in every layer
PROMPTS = [[1, 5, 9, 33], [1, 7], [1, 100, 200, 300, 400, 5, 6, 7, 8, 9, 10], [1]]


def _model(cfg=CFG, seed=0, mesh=None) -> Transformer:
    """A random model whose logits are far apart: matrices x4 (any layout, the same numbers)."""
    m = decoder(cfg, mesh.tp_group, kv_group=mesh.group("kv")) if mesh is not None else decoder(cfg)
    init_weights(m, seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim == 2:
                p.mul_(4)
    return m.eval()


def _reference(m, prompt, n) -> list[int]:
    """Greedy decoding of one sequence the plain way: no KV cache, the whole
    sequence through the model for every new token."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(min(n, m.cfg.max_seq_len - len(prompt))):
            seq.append(int(m(torch.tensor([seq]))[0, -1, :m.cfg.vocab_size].argmax()))
    return seq[len(prompt):]


def _margin(m, prompt, tokens) -> float:
    """Smallest gap between the top two logits along a greedy continuation."""
    with torch.no_grad():
        logits = m(torch.tensor([prompt + tokens[:-1]]))[0, len(prompt) - 1:, :CFG.vocab_size]
    top2 = logits.topk(2, dim=-1).values
    return float((top2[:, 0] - top2[:, 1]).min())


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return _model()


def test_batched_greedy_equals_each_prompt_alone(model):
    alone = [_reference(model, p, 12) for p in PROMPTS]
    assert min(_margin(model, p, a) for p, a in zip(PROMPTS, alone)) > 1e-3    # argmaxes are not near-ties
    assert gen.generate_lists(model, PROMPTS, 12) == alone
    assert [gen.generate_lists(model, [p], 12)[0] for p in PROMPTS] == alone
    # padding is invisible: the batched prefill's last-token logits equal each prompt's alone
    cache = gen.new_cache(model, len(PROMPTS), 16)
    batched = gen.prefill(model, cache, PROMPTS)
    for i, p in enumerate(PROMPTS):
        one = gen.prefill(model, gen.new_cache(model, 1, 16), [p])[0]
        torch.testing.assert_close(batched[i], one, rtol=1e-5, atol=1e-5)


def test_rows_stop_at_their_own_budget_and_at_eos(model):
    out = gen.generate_lists(model, PROMPTS[:2], [3, 7])
    assert [len(o) for o in out] == [3, 7]
    eos = _reference(model, PROMPTS[1], 5)[2]                # the third token row 1 makes: call it eos
    out = gen.generate_lists(model, PROMPTS[:2], 5, eos_id=eos)
    assert out[1] == _reference(model, PROMPTS[1], 3) and out[0] == _reference(model, PROMPTS[0], 5)[:len(out[0])]
    # a row stops at the model's max_seq_len
    long = [1] * (CFG.max_seq_len - 2)
    assert [len(o) for o in gen.generate_lists(model, [long, [1]], 5)] == [2, 5]


def test_sampling_is_seeded(model):
    a = gen.generate_lists(model, PROMPTS, 6, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(3))
    b = gen.generate_lists(model, PROMPTS, 6, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(3))
    assert a == b and a != gen.generate_lists(model, PROMPTS, 6)


def test_static_and_continuous_batching_give_each_request_its_own_tokens(model):
    outputs = {}
    for serve in (serving.serve_static, serving.serve_continuous):
        reqs = serving.arrival_stream(8, 500.0, CFG.vocab_size, seed=1, prompt_len=(2, 12), new_tokens=(2, 16))
        stats = serve(model, reqs, 3)
        assert stats["tokens"] == sum(r.max_new_tokens for r in reqs)
        assert all(r.finish >= r.arrival for r in reqs)
        outputs[serve.__name__] = [r.output for r in reqs]
    alone = [_reference(model, r.prompt, r.max_new_tokens) for r in reqs]
    assert outputs["serve_static"] == alone and outputs["serve_continuous"] == alone


def test_continuous_batching_admits_into_a_running_batch(model):
    """Slot reuse: with 2 slots and 4 requests present at once, requests 2 and 3
    start (and finish) while the long request 0 is still decoding."""
    reqs = [serving.Request(i, [1, 2 + i], n, 0.0) for i, n in enumerate([20, 2, 2, 2])]
    serving.serve_continuous(model, reqs, 2)
    assert max(r.finish for r in reqs[1:]) < reqs[0].finish
    reqs = [serving.Request(i, [1, 2 + i], n, 0.0) for i, n in enumerate([20, 2, 2, 2])]
    serving.serve_static(model, reqs, 2)                       # the static batch holds them back
    assert reqs[1].finish == reqs[0].finish < reqs[2].finish


def test_speculative_greedy_equals_target_greedy(model):
    draft = _model(dataclasses.replace(CFG, n_layers=1), seed=7)
    prompt = PROMPTS[2]
    target_alone = _reference(model, prompt, 30)
    for k in (1, 3):
        out, stats = serving.speculative_generate(model, draft, prompt, 30, k=k)
        assert out == target_alone
        assert stats["accepted"] + stats["target_passes"] == 30     # each pass: the accepted drafts + 1
        # a round checks its drafts up to the first rejection: at most one rejection per target pass
        assert stats["accepted"] <= stats["checked"] <= stats["proposed"]
        assert stats["checked"] - stats["accepted"] <= stats["target_passes"]
    assert stats["checked"] < stats["proposed"]     # k = 3, a random draft: drafts after a rejection go unchecked
    # the target as its own draft: every proposal is accepted, 5 tokens per target pass
    out, stats = serving.speculative_generate(model, model, prompt, 30, k=4)
    assert out == target_alone and stats["accepted"] == stats["checked"] == stats["proposed"]
    assert stats["target_passes"] == 6


@pytest.fixture(scope="module")
def moe_model():
    torch.set_num_threads(1)
    return _model(MOE_CFG, seed=4)


def test_a_mixture_of_experts_decodes_serves_and_speculates_like_each_prompt_alone(moe_model, model):
    """Every token routes on its own (dropless), so the KV-cache decode, batching with
    padding, both schedulers and speculative decoding (a MoE target with a dense draft,
    and a dense target with a MoE draft) give the plain no-cache greedy tokens."""
    assert all(moe_model.cfg.is_moe_layer(i) for i in range(MOE_CFG.n_layers))
    alone = [_reference(moe_model, p, 12) for p in PROMPTS]
    assert min(_margin(moe_model, p, a) for p, a in zip(PROMPTS, alone)) > 1e-3
    assert len({t for a in alone for t in a}) > 8                 # not one token repeated
    assert gen.generate_lists(moe_model, PROMPTS, 12) == alone
    for serve in (serving.serve_static, serving.serve_continuous):
        reqs = serving.arrival_stream(6, 500.0, MOE_CFG.vocab_size, seed=3, prompt_len=(2, 12), new_tokens=(2, 12))
        serve(moe_model, reqs, 3)
        assert [r.output for r in reqs] == [_reference(moe_model, r.prompt, r.max_new_tokens) for r in reqs]
    prompt = PROMPTS[2]
    for target, draft in ((moe_model, model), (model, moe_model)):
        out, stats = serving.speculative_generate(target, draft, prompt, 20, k=3)
        assert out == _reference(target, prompt, 20) and stats["accepted"] + stats["target_passes"] == 20


def test_tokens_per_pass_formula():
    assert serving.tokens_per_pass_formula(0.0, 4) == 1.0              # every first draft rejected
    assert serving.tokens_per_pass_formula(1.0, 4) == 5.0              # the limit, not 0/0
    assert serving.tokens_per_pass_formula(0.5, 2) == pytest.approx(1.75)     # 1 + 1/2 + 1/4


def test_the_speculative_report_says_what_it_measured():
    st = {"proposed": 84, "checked": 47, "accepted": 26, "target_passes": 22, "draft_passes": 84}
    lines = serving.report(4, 48, st, t_alone=0.1, t_draft=0.05, t_spec=0.2)
    assert lines[0].startswith("drafts kept: 26 of 84 proposed (0.31); checked up to a round's first rejection: 47")
    assert lines[1] == "per-token acceptance a = accepted / checked = 26 / 47 = 0.55"
    a = 26 / 47
    assert lines[2].startswith(f"tokens per target pass: measured 2.18, formula (1 - a^(k+1)) / (1 - a) = "
                               f"{(1 - a ** 5) / (1 - a):.2f} with k = 4")
    # 22 passes, 47 - 26 = 21 rejections: 26 / 22 accepted per pass <= a / (1 - a) = 26 / 21
    assert lines[3] == ("whatever the pattern of rejections: 1 <= measured <= min(k + 1, 1 / (1 - a)) = 2.24 "
                        "(a pass ends at its first rejection)")
    assert "c = 0.50 of a target decode step" in lines[4]
    assert lines[5].startswith("speed-up: measured 0.50x; from the passes 0.75x = 48 tokens / (22 target + 0.50 x 84")
    assert lines[6].startswith("speculative decoding pays here when c < 0.31 = (48 - 22) / 84")


def test_tokens_per_pass_bound_holds_for_every_pattern_of_rejections():
    """The bound is exact, not an expectation: on any run, tokens / target passes
    <= min(k + 1, 1 / (1 - a)). Checked on every way 3 rounds of k = 3 can keep
    their drafts (i kept, then a rejection; or all k kept)."""
    import itertools
    k = 3
    for kept in itertools.product(range(k + 1), repeat=3):
        accepted = sum(kept)
        checked = sum(i + (i < k) for i in kept)          # a round stops at its first rejection
        tokens, passes = accepted + len(kept), len(kept)
        a = accepted / checked
        assert 1 <= tokens / passes <= serving.tokens_per_pass_bound(a, k) + 1e-12, kept
        if all(i < k for i in kept):                     # every round rejected once: the bound is reached
            assert tokens / passes == pytest.approx(serving.tokens_per_pass_bound(a, k))
    assert serving.tokens_per_pass_bound(1.0, 4) == 5.0 and serving.tokens_per_pass_bound(0.0, 4) == 1.0


def test_speculative_command_prints_acceptance_beside_the_formula(checkpoint_dir, short_draft_dir, capsys):
    code = serving.main(["--target", checkpoint_dir, "--draft", short_draft_dir, "--max-new-tokens", "20",
                         "--k", "3", "--device", "cpu", "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    for label in ("target alone: 20 tokens, 20 target passes", "draft alone:  20 tokens, 20 draft passes",
                  "per-token acceptance a = accepted / checked = ", "formula (1 - a^(k+1)) / (1 - a) = ",
                  "1 <= measured <= min(k + 1, 1 / (1 - a)) = ",
                  "a draft decode step costs c = ", "speed-up: measured ", "pays here when c < ",
                  "same tokens as the target alone: yes"):
        assert label in out, (label, out)
    assert serving.main(["--target", checkpoint_dir, "--draft", checkpoint_dir, "--threads", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --threads must be at least 1") and "\n" not in err


def test_accept_or_resample_keeps_the_target_distribution():
    """Draw from q, accept or resample: the tokens follow p (not q), within
    sampling error (4 standard errors on 20,000 draws)."""
    p = torch.tensor([0.5, 0.2, 0.2, 0.1, 0.0])
    q = torch.tensor([0.1, 0.1, 0.3, 0.2, 0.3])
    g = torch.Generator().manual_seed(0)
    n = 20_000
    drafts = torch.multinomial(q, n, replacement=True, generator=g).tolist()
    counts = torch.zeros(5)
    accepted = 0
    for d in drafts:
        t, ok = serving.accept_or_resample(p, q, d, g)
        counts[t] += 1
        accepted += ok
    freq = counts / n
    assert torch.all((freq - p).abs() <= 4 * (p * (1 - p) / n).sqrt() + 1e-9), freq
    assert abs(accepted / n - float(torch.minimum(p, q).sum())) < 0.02     # acceptance = sum min(p, q)


# -- tensor parallel: one spawned gloo group of 2 for every case ----------------

TP_CASES = {"mha": 4, "gqa": 2, "replicated-kv": 1,        # kv heads of a 4-head model at tp 2
            "moe": 2}                                      # a mixture of experts: every rank holds all experts


def _tp_cfg(case: str):
    return dataclasses.replace(MOE_CFG if case == "moe" else CFG, n_heads=4, n_kv_heads=TP_CASES[case])


def _tp_worker(rank: int, world: int, out_dir: str) -> None:
    """One of 2 tp ranks (dist_utils.spawn_workers): every TP_CASES model, batched and continuous."""
    torch.set_num_threads(1)
    from nanohlat import device as devicelib
    from nanohlat.mesh import Mesh, kv_replicas
    dev = devicelib.get_device("cpu")
    dev.init_process_group(rank, 2)
    results = {}
    for name, kv in TP_CASES.items():
        cfg = _tp_cfg(name)
        try:
            gen.check_tp(cfg, 2)
        except UserError as e:
            results[name] = f"refused: {e}"
            continue
        mesh = Mesh(2, 1, 1, rank, kv_replicas=kv_replicas(cfg, 2)).build_groups(dev)
        m = _model(cfg, seed=5, mesh=mesh)
        reqs = serving.arrival_stream(4, 1e4, cfg.vocab_size, seed=2, prompt_len=(2, 9), new_tokens=(3, 9))
        serving.serve_continuous(m, reqs, 2)
        results[name] = {"batched": gen.generate_lists(m, PROMPTS, 10),
                         "continuous": [r.output for r in reqs],
                         "cache_kv_heads": gen.new_cache(m, 1, 4)[0][0].shape[1]}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    from dist_utils import spawn_workers
    out = str(tmp_path_factory.mktemp("tp"))
    spawn_workers(_tp_worker, 2, (out,), os.path.join(out, "errors"))
    return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(2)]


@pytest.mark.parametrize("case", list(TP_CASES))
def test_tensor_parallel_generation_equals_one_process(tp_results, case):
    got = tp_results[0][case]
    assert not isinstance(got, str), got                                # every case's layout is accepted
    assert tp_results[1][case] == got                                   # both ranks produced the same tokens
    cfg = _tp_cfg(case)
    m = _model(cfg, seed=5)
    assert got["batched"] == [_reference(m, p, 10) for p in PROMPTS]
    reqs = serving.arrival_stream(4, 1e4, cfg.vocab_size, seed=2, prompt_len=(2, 9), new_tokens=(3, 9))
    assert got["continuous"] == [_reference(m, r.prompt, r.max_new_tokens) for r in reqs]
    assert got["cache_kv_heads"] == max(1, TP_CASES[case] // 2)        # the cache holds this rank's kv heads


# -- sample.py: --nproc 2 --tp 2 prints what one process prints ---------------

@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory, cache_dir):
    from nanohlat.run import checkpoint, data
    tok = data.prepare_data("", "", CFG.vocab_size, cache_dir, log=lambda *a: None).tokenizer
    m = _model(CFG, seed=11)
    out = str(tmp_path_factory.mktemp("ckpt"))
    checkpoint.save_full(out, CFG, m.state_dict(), tok.path)
    return out


def _sample(args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


@pytest.mark.slow
def test_sample_py_tensor_parallel_and_batched_print_what_one_process_prints(checkpoint_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def \nimport os\\nimport sys\n\nclass Parser:\n")
    common = ["--checkpoint", checkpoint_dir, "--top-k", "1", "--max-new-tokens", "12", "--device", "cpu"]
    single = _sample(common + ["--prompt", "def "])
    assert single.returncode == 0, single.stderr
    tp = _sample(common + ["--prompt", "def ", "--nproc", "2", "--tp", "2"])
    assert tp.returncode == 0, tp.stderr
    assert tp.stdout == single.stdout and single.stdout.startswith("def ")
    one_by_one = _sample(common + ["--prompt-file", str(prompts)])
    batched = _sample(common + ["--prompt-file", str(prompts), "--batch-size", "3"])
    assert one_by_one.returncode == 0 and batched.returncode == 0, one_by_one.stderr + batched.stderr
    assert batched.stdout == one_by_one.stdout
    assert batched.stdout.count("--- prompt ") == 3 and "import os\nimport sys" in batched.stdout
    assert batched.stdout.split("--- prompt 1 ---\n")[1].split("--- prompt 2 ---")[0] == single.stdout


def test_sample_py_refuses_a_tp_degree_the_model_cannot_split(checkpoint_dir):
    p = _sample(["--checkpoint", checkpoint_dir, "--nproc", "3", "--tp", "3"])
    assert p.returncode == 2 and "--tp 3 does not divide" in p.stderr and "Traceback" not in p.stderr
    p = _sample(["--checkpoint", checkpoint_dir, "--nproc", "2"])
    assert p.returncode == 2 and "--tp 1 but 2 process(es)" in p.stderr


def test_plan_kv_cache_bytes_match_the_cache(model):
    from nanohlat import plan
    assert gen.cache_bytes(gen.new_cache(model, 3, 20)) == plan.kv_cache_bytes(CFG, 3 * 20, 4)
    assert plan.kv_cache_bytes(PRESETS["hlat-7b"][0], 4096, 2) == 2 * 2**30        # 512 KiB per token
    assert plan.kv_cache_bytes(PRESETS["hlat-70b"][0], 4096, 2) == 1.25 * 2**30    # GQA: 8 kv heads
    from nanohlat import recipe
    text = plan.report(*recipe.parse_args(["--preset", "hlat-70b"]), 2048)
    assert "x 80 layers = 320.00 KiB per token" in text and "8x larger (10.00 GiB per sequence)" in text
    assert "  8                      32,768    10.00 GiB             1.25 GiB" in text   # batch 8 at 4096, tp 32


# -- serving checks its inputs: contexts, long prompts, non-finite weights ----

@pytest.fixture(scope="module")
def short_draft_dir(tmp_path_factory, cache_dir):
    """A 1-layer draft whose context (32) is shorter than the target's (tiny: 64)."""
    from nanohlat.run import checkpoint, data
    tok = data.prepare_data("", "", CFG.vocab_size, cache_dir, log=lambda *a: None).tokenizer
    cfg = dataclasses.replace(CFG, n_layers=1, max_seq_len=32)
    out = str(tmp_path_factory.mktemp("draft"))
    checkpoint.save_full(out, cfg, _model(cfg, seed=3).state_dict(), tok.path)
    return out


def test_a_draft_with_a_shorter_context_is_refused_not_cut_short(model, checkpoint_dir, short_draft_dir, capsys):
    draft = _model(dataclasses.replace(CFG, n_layers=1, max_seq_len=32), seed=3)
    with pytest.raises(UserError, match="the draft's context is 32 tokens"):
        serving.speculative_generate(model, draft, [1, 5, 9], 40)
    out, _ = serving.speculative_generate(model, draft, [1, 5, 9], 20)    # within both contexts: fine
    assert out == _reference(model, [1, 5, 9], 20)
    code = serving.main(["--target", checkpoint_dir, "--draft", short_draft_dir, "--max-new-tokens", "40",
                         "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: the draft's context is 32") and "\n" not in err, err


def test_a_prompt_longer_than_the_context_keeps_its_end_with_a_note(checkpoint_dir, capsys):
    import sample
    long = "x = 1\n" * 200
    code = serving.main(["--target", checkpoint_dir, "--draft", checkpoint_dir, "--prompt", long,
                         "--max-new-tokens", "4", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 0 and "does not fit the model's context of 64: its first token and its last 32 are kept" in err
    assert "Traceback" not in err
    assert sample.main(["--checkpoint", checkpoint_dir, "--prompt", long, "--max-new-tokens", "4",
                        "--device", "cpu"]) == 0
    assert "does not fit the model's context of 64" in capsys.readouterr().err
    assert len(gen.fit_prompt(list(range(100)), 64, 4)) == 33


def test_max_new_tokens_beyond_the_context_is_noted_in_speculative_decoding(checkpoint_dir, capsys):
    assert serving.main(["--target", checkpoint_dir, "--draft", checkpoint_dir, "--max-new-tokens", "500",
                         "--device", "cpu"]) == 0
    assert "not --max-new-tokens 500" in capsys.readouterr().err


def test_a_checkpoint_with_nan_weights_is_one_line_naming_it(tmp_path, cache_dir, capsys):
    import sample
    from nanohlat.run import checkpoint, data
    tok = data.prepare_data("", "", CFG.vocab_size, cache_dir, log=lambda *a: None).tokenizer
    state = _model(CFG, seed=2).state_dict()
    next(iter(state.values()))[0] = float("nan")
    checkpoint.save_full(str(tmp_path), CFG, state, tok.path)
    assert sample.main(["--checkpoint", str(tmp_path), "--max-new-tokens", "4", "--temperature", "1",
                        "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: checkpoint ") and str(tmp_path) in err and "non-finite weights" in err, err
    assert "\n" not in err
    with pytest.raises(UserError, match="logits are not finite"):
        gen.pick(torch.tensor([[0.0, float("nan")]]), temperature=1.0)
