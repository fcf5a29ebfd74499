"""hybridpar.files.atomic_write: the one atomic writer."""

import os
import stat

import pytest

from hybridpar.files import atomic_write


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_text_bytes_and_writer_land_whole_with_the_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        a = atomic_write(tmp_path / "sub" / "a.json", '{"x": 1}')
        b = atomic_write(tmp_path / "b.bin", b"\x00\x01")
        c = atomic_write(tmp_path / "c.txt", lambda f: f.write(b"via writer"))
    finally:
        os.umask(old)
    assert a.read_text() == '{"x": 1}' and b.read_bytes() == b"\x00\x01" and c.read_text() == "via writer"
    assert {_mode(p) for p in (a, b, c)} == {0o644}  # open()'s mode, not mkstemp's 0600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.bin", "c.txt", "sub"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "plan.json"
    atomic_write(target, "old")

    def boom(f):
        f.write(b"half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        atomic_write(target, boom)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
