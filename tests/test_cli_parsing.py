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
