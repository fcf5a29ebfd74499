"""The one parse_int_list every command uses."""

import pytest

from hybridpar.cli.parsing import parse_int_list
from hybridpar.errors import UserError


def test_plain_and_suffixed_lists():
    assert parse_int_list("16, 64,,256", "--batches") == (16, 64, 256)
    assert parse_int_list("4K,1m,512", "--sizes", binary_suffixes=True) == (4096, 1 << 20, 512)


@pytest.mark.parametrize("text,kw", [("", {}), ("8,x", {}), ("0,4", {}), ("-2", {}), ("4K", {}),
                                     ("1.5M", {"binary_suffixes": True})])
def test_bad_lists_are_one_line_naming_the_option(text, kw):
    with pytest.raises(UserError, match=r"^--opt .*positive integers") as err:
        parse_int_list(text, "--opt", **kw)
    assert "\n" not in str(err.value)


def test_the_library_speaks_its_own_words_and_the_cli_names_the_flag(capsys):
    import hybridpar
    from hybridpar.cli.main import main

    with pytest.raises(UserError, match=r"^gpus must be >= 1") as err:
        hybridpar.plan("small_cnn", "localhost", gpus=0, batch=8)
    assert err.value.param == "gpus"
    with pytest.raises(UserError, match=r"^time_limit_s must be > 0"):
        hybridpar.place("small_cnn", "dgx1-v100", devices=2, time_limit_s=0)
    assert main(["plan", "--model", "small_cnn", "--cluster", "localhost", "--gpus", "0", "--batch", "8"]) == 2
    assert main(["place", "--model", "small_cnn", "--devices", "2", "--time-limit", "0"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["hybridpar: error: --gpus must be >= 1, got 0",
                     "hybridpar: error: --time-limit must be > 0, got 0.0"]
