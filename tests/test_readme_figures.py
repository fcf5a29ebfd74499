"""README.md and docs/results.md: no figure the code computes is typed by hand, and the README stays a
front door. The figures live in marked regions that scripts/write_figures.py (`make figures`) writes;
these tests recompute them and fail when a file says something else."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# a few plans and the GPU check's table; "projection" runs DLPlacer's ILP several times (slow)
FAST = ("make-run", "lassen", "nvlink", "gpu-check")


def _load_script():
    spec = importlib.util.spec_from_file_location("write_figures", ROOT / "scripts" / "write_figures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


wf = _load_script()


@pytest.fixture(scope="module")
def fast_figures() -> dict[str, str]:
    return wf.compute(FAST)


def test_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "a date in the README"
    assert not re.search(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", text), "a commit hash"
    assert not re.search(r"\bissue \d+", text, re.I), "an issue number"


def test_every_region_is_one_the_script_writes():
    names = {n for p in wf.FILES for n in wf.regions(p.read_text())}
    assert names == {n for group in wf.REGION_NAMES.values() for n in group}
    assert {"make-run"} <= set(wf.regions(README.read_text()))


def test_fast_figures_match_the_code(fast_figures):
    assert set(fast_figures) == {n for g in FAST for n in wf.REGION_NAMES[g]}
    diffs = wf.stale(wf.FILES, fast_figures)
    assert not diffs, "figures differ from the code; run `make figures`:\n" + "".join(diffs)


@pytest.mark.slow
def test_projection_figures_match_the_code(request, monkeypatch):
    # DLPlacer's ILP dominates (minutes with cold caches). Its placements are cached on disk under keys
    # that include a fingerprint of the cost, cluster, graph and search code, so a cache kept between
    # sessions (pytest's own folder) never returns a figure the code no longer computes.
    monkeypatch.setenv("HYBRIDPAR_CACHE", str(request.config.cache.mkdir("hybridpar-figures")))
    new = wf.compute(("projection",))
    diffs = wf.stale(wf.FILES, new)
    assert not diffs, "figures differ from the code; run `make figures`:\n" + "".join(diffs)


def test_a_figure_typed_by_hand_is_caught(fast_figures, tmp_path):
    copy = tmp_path / "README.md"
    shutil.copy(README, copy)
    fast_figures = {k: v for k, v in fast_figures.items() if k in wf.regions(README.read_text())}
    assert wf.stale([copy], fast_figures) == []
    text = copy.read_text()
    body = wf.regions(text)["make-run"]
    figure = re.search(r"\d+\.\d\d×", body).group()
    edited = body.replace(figure, f"{float(figure[:-1]) + 0.01:.2f}×", 1)
    copy.write_text(text.replace(body, edited))
    diffs = wf.stale([copy], fast_figures)
    assert len(diffs) == 1 and f"-{edited.strip()}" in diffs[0] and f"+{body.strip()}" in diffs[0]
    # rewriting puts the computed figure back and touches nothing outside the regions
    assert wf.rewrite(copy.read_text(), fast_figures) == text


def test_a_region_missing_from_the_files_is_reported(fast_figures, tmp_path):
    copy = tmp_path / "README.md"
    copy.write_text(re.sub(r"<!-- /?figures:make-run -->\n?", "", README.read_text()))
    assert any("figures:make-run " in d for d in wf.stale([copy], fast_figures))
