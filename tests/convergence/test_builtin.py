import json

import pytest

from hybridpar.convergence.builtin import builtin_curve, builtin_models, load_curve
from hybridpar.errors import UserError


def test_paper_workloads_have_curves_that_grow_with_batch():
    assert {"resnet50", "inception_v3", "gnmt", "biglstm"} <= set(builtin_models())
    for m in ("resnet50", "inception_v3", "gnmt", "biglstm"):
        w = builtin_curve(m)
        c = w.curve
        assert c.epochs(64) < c.epochs(8192) < c.epochs(65536)
        assert w.samples_per_epoch and w.samples_per_epoch > 1e6


def test_fit_tracks_published_points():
    # ResNet-50 MLPerf RCPs: 35 epochs at 1632, 84.5 at 65536 (data/published.yaml)
    c = builtin_curve("resnet50").curve
    assert c.epochs(1632) == pytest.approx(35.0, rel=0.1)
    assert c.epochs(65536) == pytest.approx(84.5, rel=0.1)
    g = builtin_curve("gnmt").curve
    assert g.epochs(16384) == pytest.approx(9.2, rel=0.15)


def test_borrowed_curves_say_so_and_are_wider():
    own, borrowed = builtin_curve("resnet50"), builtin_curve("inception_v3")
    assert borrowed.borrowed and "BORROWED" in " ".join(borrowed.notes())
    lo_o, hi_o = own.curve.epochs_band(65536)
    lo_b, hi_b = borrowed.curve.epochs_band(65536)
    assert hi_b - lo_b > 3 * (hi_o - lo_o)
    assert builtin_curve("biglstm").borrowed


def test_unknown_model_and_bad_file(tmp_path):
    with pytest.raises(UserError, match="measure-convergence"):
        builtin_curve("small_cnn")
    bad = tmp_path / "c.json"
    bad.write_text("{not json")
    with pytest.raises(UserError):
        load_curve(bad)
    with pytest.raises(UserError):
        load_curve(tmp_path / "missing.json")
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps({"curve": {"kind": "mccandlish", "e_min": 2.0, "b_noise": 100.0},
                              "samples_per_epoch": 1000}))
    w = load_curve(ok)
    assert w.curve.epochs(100) == pytest.approx(4.0) and w.samples_per_epoch == 1000


def test_every_published_point_has_a_source_and_borrowed_curves_record_the_search():
    from hybridpar.convergence.builtin import _data

    data = _data()
    for wl in data["workloads"].values():
        assert wl["points"] and all(str(p.get("source", "")).strip() for p in wl["points"])
    for m in data["models"].values():
        if m.get("borrowed"):
            assert m["why"].startswith("BORROWED CURVE")
            assert m.get("searched") and any("Shallue" in s for s in m["searched"])
