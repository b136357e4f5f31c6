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
from nanohlat.config import ModelConfig, UserError
from nanohlat.model import Transformer, init_weights

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

TOL = 1e-5

# GQA (2 kv heads for 4 query heads) and a vocabulary of 300 (not a multiple of
# 128, so nanohlat pads it to 384 and the conversion must drop / add 84 rows).
CFG = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=80, vocab_size=300,
                  max_seq_len=64, rope_theta=5000.0, norm_eps=1e-6)


def nanohlat_model(cfg=CFG, seed=0):
    model = Transformer(cfg)
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
    ours = Transformer(cfg)
    ours.load_state_dict(state, strict=True)
    x = tokens(cfg)
    diff = (ours.eval()(x) - theirs(x).logits).abs().max().item()
    assert diff < TOL, diff


def test_import_with_padding_keeps_logits_and_pads_with_zeros():
    theirs = hf_model(hf.to_hf_config(CFG))
    cfg, state = hf.from_hf_state(theirs.config.to_dict(), theirs.state_dict(), vocab_multiple=128)
    assert cfg.padded_vocab == 384 and state["head.weight"][300:].abs().sum() == 0
    ours = Transformer(cfg).eval()
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
    again = Transformer(cfg).eval()
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
