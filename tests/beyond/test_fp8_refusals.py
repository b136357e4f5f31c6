"""--fp8's bad input: one line, exit 2 (recipe/layouts.py:check_fp8_recipe, recipe/command_line.py, run/preflight.py).

An unknown recipe, a flag of FP8's without --fp8 (or of delayed scaling's without it), what FP8 is not
built with (--compile, zb-h1, capacity-mode experts, blockwise and mx experts whose rows sequence
parallelism or --cp spread over ranks), --fp8 on xla, and under blockwise and mx a reduction longer
than one block and not a multiple of it (a shorter one is one block, as if zero-padded). The recipe's
names and block lengths that reading the flags must know without importing beyond/ equal beyond/'s.
"""

from __future__ import annotations

import pytest

from nanohlat import recipe
from nanohlat.config import UserError
from nanohlat.recipe import configs, layouts

TINY = ["--preset", "tiny"]
WIDE = ["--preset", "tiny", "--d-model", "128", "--ffn-dim", "384"]   # every reduction tiled (kv width 64: one block)


def test_the_flags_know_beyonds_recipes_and_blocks():
    from nanohlat.beyond import fp8_scaling
    assert configs.FP8_RECIPES == fp8_scaling.RECIPES
    assert layouts.FP8_REDUCTION_BLOCK == {"blockwise": fp8_scaling.TILE, "mx": fp8_scaling.MX_BLOCK}
    assert tuple(configs.FP8_GRAD_FORMATS) == tuple(fp8_scaling.FORMATS)[::-1]


@pytest.mark.parametrize("argv, words", [
    (TINY + ["--fp8", "fp4"], "--fp8 'fp4' is not one of none, tensorwise, delayed, rowwise, blockwise, mx"),
    (TINY + ["--fp8-grad-format", "e4m3"], "--fp8-grad-format e4m3 needs --fp8"),
    (TINY + ["--fp8", "tensorwise", "--fp8-grad-format", "e3m4"], "--fp8-grad-format 'e3m4' is not one of"),
    (TINY + ["--fp8-stats", "5"], "--fp8-stats 5 needs --fp8"),
    (TINY + ["--fp8", "tensorwise", "--fp8-history", "8"], "--fp8-history 8 needs --fp8 delayed"),
    (TINY + ["--fp8", "delayed", "--fp8-history", "0"], "--fp8-history must be >= 1"),
    (TINY + ["--fp8", "delayed", "--fp8-margin", "65"], "--fp8-margin in \\[0, 64\\]"),
    (TINY + ["--fp8", "tensorwise", "--fp8-stats", "3", "--log-every", "2"], "must be a multiple of --log-every 2"),
    (TINY + ["--fp8", "tensorwise", "--compile"], "--fp8 with --compile is not built"),
    (TINY + ["--fp8", "tensorwise", "--schedule", "zb-h1", "--pp", "2", "--microbatches", "2"],
     "--fp8 with --schedule zb-h1 is not built"),
    (["--preset", "moe", "--fp8", "rowwise", "--moe-capacity-factor", "1.25"],
     "--fp8 with --moe-capacity-factor is not built"),
    (["--preset", "moe", "--fp8", "blockwise", "--tp", "2", "--sequence-parallel"],
     "an expert's rows of a micro-batch are then spread over ranks"),
    (["--preset", "moe", "--fp8", "mx", "--cp", "2"], "and --cp 2: an expert's rows"),
    (TINY + ["--fp8", "blockwise"], "the ffn width .* is 176, longer than one block and not a multiple of 128"),
    (TINY + ["--fp8", "mx"], "the ffn width .* is 176, longer than one block and not a multiple of 32"),
    (WIDE + ["--fp8", "blockwise", "--d-model", "192", "--n-heads", "8"],
     "the model width .* is 192, longer than one block"),
    (WIDE + ["--fp8", "tensorwise", "--sequence-parallel", "--tp", "2", "--sp-regather"],
     "--fp8 with --sp-regather: an FP8 linear casts its gathered input itself"),
])
def test_bad_fp8_flags_are_refused_in_one_line(argv, words):
    with pytest.raises(UserError, match=words) as e:
        recipe.parse_args(argv)
    assert "\n" not in str(e.value)


def test_what_fp8_takes():
    """Every recipe at the issue's shape; a reduction of one block or less (tiny's 64-wide model) under
    blockwise; --fp8 with sequence parallelism keeps the gathered input (--no-sp-regather), said in config."""
    for r in configs.FP8_RECIPES:
        assert recipe.parse_args(WIDE + ["--fp8", r])[1].fp8 == r
    assert recipe.parse_args(TINY + ["--fp8", "blockwise", "--ffn-dim", "128"])[1].fp8 == "blockwise"
    tcfg = recipe.parse_args(WIDE + ["--fp8", "rowwise", "--tp", "2", "--sequence-parallel"])[1]
    assert tcfg.sp_regather is False
    assert recipe.parse_args(WIDE + ["--tp", "2", "--sequence-parallel"])[1].sp_regather is True
    tcfg = recipe.parse_args(WIDE + ["--fp8", "delayed", "--fp8-history", "4", "--fp8-margin", "1",
                                     "--fp8-grad-format", "e4m3", "--fp8-stats", "5"])[1]
    assert (tcfg.fp8_history, tcfg.fp8_margin, tcfg.fp8_grad_format, tcfg.fp8_stats) == (4, 1, "e4m3", 5)


@pytest.mark.parametrize("argv, words", [
    (WIDE + ["--fp8", "fp4"], "--fp8 'fp4' is not one of"),
    (WIDE + ["--fp8", "tensorwise", "--device", "xla"], "--fp8 tensorwise is not supported on xla yet"),
    # the weight gradient's reduction: a micro-batch's tokens, 6 x 32 = 192 (known once dp is)
    (WIDE + ["--fp8", "blockwise", "--batch-size", "6"], "the tokens of a micro-batch .* is 192"),
    (TINY + ["--fp8", "mx"], "not a multiple of 32"),
])
def test_train_py_refuses_them_with_one_line_and_exit_2(argv, words, tmp_path, capsys):
    import re
    import train
    code = train.main(argv + ["--out-dir", str(tmp_path / "o"), "--steps", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and re.search(words, err), err
    assert not (tmp_path / "o").exists()
