"""Hugging Face conversion: the same weights give the same logits on both sides.

Tolerance 1e-5 on fp32 logits of order 1: the two implementations do the same
arithmetic in slightly different orders (fused vs. split rotary, SDPA vs.
eager softmax), which moves fp32 results by ~1e-6, while any mapping mistake
(a swapped projection, a transposed matrix, a wrong rotary convention or
norm epsilon) changes them by ~1e-1 or more.
"""

import importlib.util
import os

import pytest
import torch

from nanohlat.serving import hf
from nanohlat.config import UserError
from nanohlat.recipe import ModelConfig
from nanohlat.model import init_weights
from nanohlat.run.build import decoder

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

TOL = 1e-5

# GQA (2 kv heads for 4 query heads) and a vocabulary of 300 (not a multiple of
# 128, so nanohlat pads it to 384 and the conversion must drop / add 84 rows).
CFG = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=80, vocab_size=300,
                  max_seq_len=64, rope_theta=5000.0, norm_eps=1e-6)


def nanohlat_model(cfg=CFG, seed=0):
    model = decoder(cfg)
    init_weights(model, seed)
    with torch.no_grad():   # init leaves norms at 1: perturb them so a swapped norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return model.eval()


def hf_model(hf_config: dict):
    config = transformers.LlamaConfig(**{k: v for k, v in hf_config.items() if k != "architectures"})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager").float()
    with torch.no_grad():   # HF initialises norms to 1 too; and its default std would leave logits tiny
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape) * (0.1 if name.endswith("norm.weight") else 0.2) + ("norm" in name))
    return model.eval()


def train_tokenizer(tmp_path) -> str:
    """A 300-piece SentencePiece model with nanohlat's options (data._train_tokenizer)."""
    import sentencepiece as spm
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(400)))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "tok"), vocab_size=300, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=False, allow_whitespace_only_pieces=True, split_digits=True, minloglevel=2)
    return str(tmp_path / "tok.model")


def tokens(cfg, B=2, T=24):
    return torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))


def test_export_to_hf_gives_the_same_logits(tmp_path):
    model = nanohlat_model()
    hf_state = hf.to_hf_state(CFG, model.state_dict())
    assert hf_state["model.embed_tokens.weight"].shape == (300, 32)      # padding rows sliced off
    assert CFG.padded_vocab == 384
    theirs = hf_model(hf.to_hf_config(CFG))
    theirs.load_state_dict(hf_state, strict=True)
    x = tokens(CFG)
    ours = model(x)[..., :CFG.vocab_size]
    diff = (theirs(x).logits - ours).abs().max().item()
    assert ours.abs().max() > 0.1 and diff < TOL, diff


def test_import_from_hf_gives_the_same_logits():
    hf_config = hf.to_hf_config(CFG)
    theirs = hf_model(hf_config)
    cfg, state = hf.from_hf_state(theirs.config.to_dict(), theirs.state_dict())
    # 300 is not a multiple of 128 (nor 8): the largest power of two dividing it is 4 -> no padding
    assert (cfg.vocab_size, cfg.vocab_multiple, cfg.padded_vocab) == (300, 4, 300)
    assert (cfg.rope_theta, cfg.norm_eps, cfg.n_kv_heads) == (5000.0, 1e-6, 2)
    ours = decoder(cfg)
    ours.load_state_dict(state, strict=True)
    x = tokens(cfg)
    diff = (ours.eval()(x) - theirs(x).logits).abs().max().item()
    assert diff < TOL, diff


def test_import_with_padding_keeps_logits_and_pads_with_zeros():
    theirs = hf_model(hf.to_hf_config(CFG))
    cfg, state = hf.from_hf_state(theirs.config.to_dict(), theirs.state_dict(), vocab_multiple=128)
    assert cfg.padded_vocab == 384 and state["head.weight"][300:].abs().sum() == 0
    ours = decoder(cfg).eval()
    ours.load_state_dict(state)
    x = tokens(cfg)
    assert (ours(x)[..., :300] - theirs(x).logits).abs().max().item() < TOL


def test_files_round_trip_through_from_pretrained(tmp_path):
    """write_hf_dir -> LlamaForCausalLM.from_pretrained, and save_pretrained -> read_hf_dir."""
    tokenizer = train_tokenizer(tmp_path)
    model = nanohlat_model()
    hf_dir = tmp_path / "hf"
    hf.write_hf_dir(CFG, model.state_dict(), tokenizer, str(hf_dir))
    assert {"config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json"} <= set(os.listdir(hf_dir))
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir), attn_implementation="eager").eval()
    x = tokens(CFG)
    assert (theirs(x).logits - model(x)[..., :300]).abs().max().item() < TOL

    # The exported tokenizer tokenises like nanohlat's (BOS first, no dummy prefix, bytes
    # for unseen characters). Converting a SentencePiece file needs protobuf on the HF side.
    if importlib.util.find_spec("google.protobuf") is not None:
        from nanohlat.run.data import load_tokenizer
        ours, theirs_tok = load_tokenizer(tokenizer), transformers.AutoTokenizer.from_pretrained(str(hf_dir))
        for text in ("def f(x):\n    return x\n", "  two spaces", "h\u00e9llo \u2713 12345", "class A:\n\tpass"):
            assert theirs_tok(text)["input_ids"] == [ours.bos_id] + ours.encode(text)
            assert theirs_tok.decode(theirs_tok(text)["input_ids"], skip_special_tokens=True) == text

    saved = tmp_path / "saved"
    theirs.save_pretrained(str(saved))
    cfg, state = hf.from_hf_state(*hf.read_hf_dir(str(saved)))
    again = decoder(cfg).eval()
    again.load_state_dict(state)
    assert (again(x) - theirs(x).logits).abs().max().item() < TOL


def test_unsupported_configs_are_user_errors():
    base = hf.to_hf_config(CFG)
    state = hf.to_hf_state(CFG, nanohlat_model().state_dict())
    for change in ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]},
                   {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
                   {"attention_bias": True}, {"hidden_act": "gelu"}, {"num_hidden_layers": 3}):
        with pytest.raises(UserError):
            hf.from_hf_state({**base, **change}, state)
    with pytest.raises(UserError, match="config.json"):
        hf.read_hf_dir("/nonexistent")


def test_cli_round_trip_through_checkpoints(tmp_path, capsys):
    """export + import through the CLI entry point (needs nanohlat.run.checkpoint)."""
    ckpt = pytest.importorskip("nanohlat.run.checkpoint")
    if not hasattr(ckpt, "save_full"):
        pytest.skip("nanohlat.run.checkpoint.save_full not written yet")
    tokenizer = train_tokenizer(tmp_path)
    model = nanohlat_model()
    run = str(tmp_path / "run")
    ckpt.save_full(run, CFG, model.state_dict(), tokenizer, step=7, tokens=700)
    assert hf.main(["export", run, str(tmp_path / "hf")]) == 0          # what `python -m nanohlat.hf ...` runs
    assert hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    # bad input: one line, exit code 2
    assert hf.main(["import", str(tmp_path / "nothing"), str(tmp_path / "back2")]) == 2
    err = capsys.readouterr().err.strip()
    assert "nothing' does not exist" in err and "tokenizer.model" not in err.split(";")[0], err
    from nanohlat.device import get_device
    from nanohlat.serving.generate import load_model   # the loader of every command
    back, manifest = load_model(str(tmp_path / "back"), get_device("cpu"))
    assert os.path.isfile(manifest["tokenizer"]) and back.cfg.vocab_size == 300
    x = tokens(CFG)
    assert (back(x)[..., :300] - model(x)[..., :300]).abs().max().item() < TOL


@pytest.mark.parametrize("damage", ["config not JSON", "config without sizes", "truncated safetensors"])
def test_damaged_hf_directory_is_one_line(damage, tmp_path, capsys):
    """A malformed config.json or a truncated weights file: `import` exits 2 with one line."""
    tokenizer = train_tokenizer(tmp_path)
    hf_dir = str(tmp_path / "hf")
    hf.write_hf_dir(CFG, nanohlat_model().state_dict(), tokenizer, hf_dir)
    if damage == "config not JSON":
        with open(os.path.join(hf_dir, "config.json"), "a") as f:
            f.write("}{")
    elif damage == "config without sizes":
        with open(os.path.join(hf_dir, "config.json"), "w") as f:
            f.write('{"model_type": "llama"}')
    else:
        weights = os.path.join(hf_dir, "model.safetensors")
        with open(weights, "r+b") as f:
            f.truncate(os.path.getsize(weights) // 2)
    code = hf.main(["import", hf_dir, str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err, err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------
# A mixture of experts <-> Mixtral
# ---------------------------------------------------------------------------

def _moe_checkpoints(cache_dir, root):
    """Two checkpoints of the `moe` preset (4 layers, all sparse, 4 experts, top-2): one
    trained 10 steps (a router that has learnt something), and a random one whose
    matrices are x4, so that its greedy continuation is not one repeated token (the
    trained one's mostly is, at 10 steps) and argmaxes are far from ties."""
    import train
    from nanohlat import recipe
    from nanohlat.run import checkpoint, preflight
    trained = str(root / "trained")
    train.train(*preflight.inputs(*recipe.parse_args(
        ["--preset", "moe", "--steps", "10", "--device", "cpu", "--cache-dir", cache_dir, "--out-dir", trained,
         "--no-progress", "--eval-every", "0", "--threads", "1"])))
    cfg = recipe.PRESETS["moe"][0]
    model = decoder(cfg)
    init_weights(model, 3)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.mul_(4)
    scaled = str(root / "scaled")
    manifest = checkpoint.read_manifest(checkpoint.resolve(trained))
    checkpoint.save_full(scaled, cfg, model.state_dict(), manifest["tokenizer"], step=0)
    return {"trained": trained, "scaled": scaled}


@pytest.fixture(scope="module")
def moe_runs(cache_dir, tmp_path_factory):
    return _moe_checkpoints(cache_dir, tmp_path_factory.mktemp("moe"))


def _load(run):
    from nanohlat.device import get_device
    from nanohlat.serving.generate import load_model
    return load_model(run, get_device("cpu"))


@pytest.mark.parametrize("which", ["trained", "scaled"])
def test_moe_export_loads_in_mixtral_with_the_same_logits_and_greedy_tokens(moe_runs, which, tmp_path, capsys):
    """`python -m nanohlat.hf export` of a MoE run -> MixtralForCausalLM.from_pretrained
    (its config built from the exported config.json): the same logits to fp32
    round-off (measured: 4.8e-7 trained, 1.4e-6 scaled, on logits up to 1.3 and 2.7),
    and Hugging Face's greedy generate() gives the tokens sample.py --top-k 1 prints."""
    import json
    import sample
    from nanohlat.run.data import load_tokenizer
    run, hf_dir = moe_runs[which], str(tmp_path / "hf")
    assert hf.main(["export", run, hf_dir]) == 0
    assert "MixtralForCausalLM" in capsys.readouterr().out
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = transformers.MixtralConfig(**json.load(f))
    assert (config.num_local_experts, config.num_experts_per_tok, config.model_type) == (4, 2, "mixtral")
    theirs = transformers.MixtralForCausalLM.from_pretrained(hf_dir, config=config, attn_implementation="eager")
    theirs = theirs.float().eval()
    ours, manifest = _load(run)
    assert ours.cfg.moe_experts == 4 and all(ours.cfg.is_moe_layer(i) for i in range(ours.cfg.n_layers))
    x = torch.randint(0, ours.cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        mine, theirs_logits = ours(x)[..., :ours.cfg.vocab_size], theirs(x).logits
    scale = mine.abs().max().item()
    diff = (theirs_logits - mine).abs().max().item()
    assert scale > 0.5 and diff < TOL, (diff, scale)

    tok = load_tokenizer(manifest["tokenizer"])
    prompt, n = "def add(a, b):", 20
    ids = [tok.bos_id] + tok.encode(prompt)
    with torch.no_grad():
        out = theirs.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_id)[0, len(ids):].tolist()
        # argmaxes far from ties along the way, or equal tokens would prove nothing
        logits = ours(torch.tensor([ids + out[:-1]]))[0, len(ids) - 1:, :ours.cfg.vocab_size]
    top2 = logits.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 100 * diff
    out = out[:out.index(tok.eos_id)] if tok.eos_id in out else out
    assert sample.main(["--out-dir", run, "--prompt", prompt, "--max-new-tokens", str(n), "--top-k", "1",
                        "--device", "cpu"]) == 0
    assert capsys.readouterr().out == prompt + tok.decode(out) + "\n"
    if which == "scaled":
        assert len(set(out)) > 3, out      # a continuation, not one token repeated


def test_mixtral_aux_loss_on_one_sequence_is_nanohlats_balance_term(cache_dir, tmp_path, capsys):
    """A trained MoE run with one (sparse) layer, exported: on one sequence transformers'
    router_aux_loss_coef x aux_loss equals nanohlat's --moe-aux-coef x balance on it to 1e-5
    relative (export writes the coefficient x L / k, hf.py's docstring), and export says so."""
    import json
    import train
    from nanohlat import recipe
    from nanohlat.run import preflight
    run, hf_dir = str(tmp_path / "run"), str(tmp_path / "hf")
    train.train(*preflight.inputs(*recipe.parse_args(
        ["--preset", "moe", "--n-layers", "1", "--moe-aux-coef", "0.03", "--steps", "3", "--device", "cpu",
         "--cache-dir", cache_dir, "--out-dir", run, "--no-progress", "--eval-every", "0", "--threads", "1"])))
    capsys.readouterr()
    assert hf.main(["export", run, hf_dir]) == 0
    said = capsys.readouterr().out
    assert "router_aux_loss_coef 0.015 = --moe-aux-coef 0.03 x 1 layers / top-2" in said, said
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = transformers.MixtralConfig(**json.load(f))
    theirs = transformers.MixtralForCausalLM.from_pretrained(hf_dir, config=config, attn_implementation="eager")
    theirs = theirs.float().eval()
    ours, _ = _load(run)
    x = torch.randint(0, ours.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ours(x)
        aux = theirs(x, output_router_logits=True).aux_loss
    (balance, _), = [block.mlp.losses for block in ours.layers.values()]
    mine, hf_term = ours.cfg.moe_aux_coef * balance.double().sum(), config.router_aux_loss_coef * aux.double()
    assert balance.shape == (1,) and float(balance) > 1.0        # a router that is not perfectly balanced
    assert abs(float(hf_term) - float(mine)) <= 1e-5 * abs(float(mine)), (float(hf_term), float(mine))
    # and back: import gives nanohlat's coefficient again
    with open(os.path.join(hf_dir, "config.json")) as f:
        assert hf.from_hf_config(json.load(f)).moe_aux_coef == pytest.approx(0.03, rel=1e-12)


def test_moe_import_round_trips_bit_for_bit(moe_runs, tmp_path):
    """export -> import gives back every tensor bit for bit, and so does a pass
    through transformers (from_pretrained, save_pretrained: the per-expert layout
    it writes back) -> import."""
    ours, _ = _load(moe_runs["trained"])
    hf_dir, saved = str(tmp_path / "hf"), str(tmp_path / "saved")
    assert hf.main(["export", moe_runs["trained"], hf_dir]) == 0
    transformers.MixtralForCausalLM.from_pretrained(hf_dir).save_pretrained(saved)
    for i, folder in enumerate((hf_dir, saved)):
        assert hf.main(["import", folder, str(tmp_path / f"back{i}"), "--tokenizer",
                        os.path.join(hf_dir, "tokenizer.model")]) == 0
        back, _ = _load(str(tmp_path / f"back{i}"))
        assert back.cfg == ours.cfg    # (the preset's z coefficient is the default, which import gives)
        mine, theirs = ours.state_dict(), back.state_dict()
        assert set(mine) == set(theirs) and any(".mlp.router." in n for n in mine)
        for name in mine:
            assert torch.equal(mine[name], theirs[name]), name


@pytest.mark.parametrize("change", [{"moe_shared_experts": 1}, {"moe_every": 2}, {"moe_capacity_factor": 1.25}])
def test_a_mixture_mixtral_cannot_hold_is_refused_in_one_line(change, tmp_path, capsys):
    """Shared experts, dense layers between sparse ones, a capacity (dropped
    tokens): export exits 2 with one line and writes nothing."""
    import dataclasses
    from nanohlat import recipe
    from nanohlat.run import checkpoint
    cfg = dataclasses.replace(recipe.PRESETS["moe"][0], n_layers=2, **change)
    model = decoder(cfg)
    init_weights(model, 0)
    run = str(tmp_path / "run")
    checkpoint.save_full(run, cfg, model.state_dict(), train_tokenizer(tmp_path), step=0)
    assert hf.main(["export", run, str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Mixtral" in err, err
    name = "--" + next(iter(change)).replace("_", "-")
    assert name in err and not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()


def test_mixtral_configs_nanohlat_cannot_run_are_user_errors():
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=300,
                      moe_experts=4, moe_top_k=2)
    base = hf.to_hf_config(cfg)
    assert hf.from_hf_config(base, vocab_multiple=128) == cfg   # (the default z coefficient)
    for change, named in (({"sliding_window": 16}, "sliding_window"), ({"router_jitter_noise": 0.1}, "router_jitter_noise"),
                          ({"num_local_experts": None}, "num_local_experts"),
                          ({"num_experts_per_tok": 5}, "--moe-top-k 5")):
        with pytest.raises(UserError, match=named):
            hf.from_hf_config({**base, **change})


# ---------------------------------------------------------------------------
# Import refuses what export refuses, and says which file (issue 50)
# ---------------------------------------------------------------------------

MOE = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=300,
                  moe_experts=4, moe_top_k=2)


def write_hf(tmp_path, cfg, name="hf"):
    """An HF folder (config.json, model.safetensors, the tokenizer) of a fresh nanohlat model."""
    model = decoder(cfg)
    init_weights(model, 0)
    folder = tmp_path / name
    hf.write_hf_dir(cfg, model.state_dict(), train_tokenizer(tmp_path), str(folder))
    return folder


def edit_weights(folder, edit) -> str:
    import safetensors.torch as st
    path = str(folder / "model.safetensors")
    state = st.load_file(path)
    edit(state)
    st.save_file(state, path)
    return path


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("cfg", [CFG, MOE], ids=["llama", "mixtral"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_import_refuses_non_finite_weights(cfg, value, tmp_path, capsys):
    """A NaN (or inf) weight was imported, trained 3 NaN steps and ended "final loss nan", exit 0;
    export and every reader of a checkpoint refused it. Import refuses it too, naming the file and
    the tensor, and writes nothing."""
    folder = write_hf(tmp_path, cfg)
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight" if cfg.moe_experts else \
        "model.layers.1.mlp.down_proj.weight"
    path = edit_weights(folder, lambda s: s[name].view(-1).__setitem__(5, value))
    assert hf.main(["import", str(folder), str(tmp_path / "run")]) == 2
    err = one_line(capsys)
    assert err.startswith(f"error: {path} has non-finite weights (NaN or inf) in {name}: it cannot be imported"), err
    assert not (tmp_path / "run").exists()


def test_mixtral_import_errors_name_the_file_and_the_config_they_are_about(tmp_path, capsys):
    """Mixtral's errors named no weights file and called a bad Mixtral field "not a complete Llama
    config"; an unsupported router_jitter_noise or sliding_window was named as a path,
    <dir>/router_jitter_noise."""
    import json
    folder = write_hf(tmp_path, MOE)
    config = folder / "config.json"
    good = json.loads(config.read_text())
    out = str(tmp_path / "run")
    for change, want in (({"router_jitter_noise": 0.1}, f"error: {config}'s router_jitter_noise is 0.1, which nanohlat "
                                                        f"does not support (its mixture of experts has "
                                                        f"router_jitter_noise 0: full attention, a router without noise)"),
                         ({"sliding_window": 4096}, f"error: {config}'s sliding_window is 4096, which nanohlat"),
                         ({"num_local_experts": "four"}, f"error: {config}'s num_local_experts is 'four', not a whole "
                                                         f"number; it is not a complete Mixtral config"),
                         ({"hidden_act": "gelu"}, f"error: {config}: hidden_act = 'gelu' is not supported")):
        config.write_text(json.dumps({**good, **change}))
        assert hf.main(["import", str(folder), out]) == 2
        err = one_line(capsys)
        assert err.startswith(want), err
    config.write_text(json.dumps(good))
    name = "model.layers.0.block_sparse_moe.experts.2.w1.weight"
    path = edit_weights(folder, lambda s: s.update({name: s[name][:, :5].contiguous()}))
    assert hf.main(["import", str(folder), out]) == 2
    assert one_line(capsys).startswith(f"error: {path}: {name} has shape (48, 5), expected (48, 32) from config.json")
    edit_weights(folder, lambda s: s.pop(name))
    assert hf.main(["import", str(folder), out]) == 2
    assert one_line(capsys).startswith(f"error: {path}: not a Mixtral state of its config.json (missing ['{name}']")


def test_export_overwrite_onto_a_file_says_it_is_a_file(tmp_path, capsys):
    """It said "Not a directory; free space, fix the permissions or choose another path"."""
    from nanohlat.run import checkpoint
    model = nanohlat_model()
    run = str(tmp_path / "run")
    checkpoint.save_full(run, CFG, model.state_dict(), train_tokenizer(tmp_path), step=0)
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    assert hf.main(["export", run, str(target), "--overwrite"]) == 2
    assert one_line(capsys) == (f"error: HF_DIR {str(target)!r} is a file, not a folder; choose a new folder "
                                f"(--overwrite replaces the files inside one)")
    assert target.read_text() == "mine"
