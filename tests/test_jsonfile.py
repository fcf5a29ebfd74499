"""Bad JSON files (plans, measured runs) are one UserError line, whatever is wrong with them."""

import pytest

from hybridpar.errors import UserError
from hybridpar.plans import load_plan
from hybridpar.report.measured import load_measured


@pytest.mark.parametrize("content", [b"\xff\xfe\x00garbage", b"{not json", b"[" * 100_000, None])
@pytest.mark.parametrize("loader", [load_plan, load_measured])
def test_bad_json_file_is_one_line_user_error(tmp_path, loader, content):
    path = tmp_path / "f.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UserError) as err:
        loader(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)
