"""docs/spatial.md's worked example is computed, not typed: its regions equal what
scripts/write_figures.py's `spatial` group computes now (about 15 s: five plans of the U-Net at
3x1024x1024 on Lassen, two fixed ResNet-50 layouts)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow  # 15-25 s on this machine (the planner at 1024x1024, five times)
def test_spatial_doc_figures_match_the_code():
    spec = importlib.util.spec_from_file_location("write_figures", ROOT / "scripts" / "write_figures.py")
    wf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wf)
    new = wf.compute(("spatial",))
    assert set(new) == {"spatial-unet", "spatial-resnet"}
    assert "spatial chosen for time" in new["spatial-unet"]
    diffs = wf.stale([ROOT / "docs" / "spatial.md"], new)
    assert not diffs, "docs/spatial.md differs from the code; run `python scripts/write_figures.py --only spatial`:\n" \
        + "".join(diffs)
