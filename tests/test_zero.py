"""ZeRO stages beside each other (zero1.py): the --zero flag and its old spelling --zero1."""

from __future__ import annotations

import pytest

from nanohlat import config
from nanohlat.config import UserError

TINY = ["--preset", "tiny"]


def test_zero1_is_the_older_spelling_of_zero_1():
    assert config.parse_args(TINY + ["--zero1"])[1].zero == 1
    assert config.parse_args(TINY + ["--zero", "1"])[1].zero == 1
    assert config.parse_args(TINY)[1].zero == 0
    assert config.parse_args(["--preset", "hlat-70b"])[1].zero == 1


@pytest.mark.parametrize("argv, words", [(["--zero", "4"], "not a ZeRO stage"),
                                         (["--zero", "-1"], "not a ZeRO stage"),
                                         (["--zero1", "--zero", "0"], "older spelling")])
def test_bad_zero_flags_are_refused_in_one_line(argv, words):
    with pytest.raises(UserError, match=words) as e:
        config.parse_args(TINY + argv)
    assert "\n" not in str(e.value)
