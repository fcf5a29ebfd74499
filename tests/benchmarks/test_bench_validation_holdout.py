"""benchmarks/holdout.yaml as bench_validation.py reads it: every group planned and trained, and a
group's optional `loss:` key passed as `--loss X` to its `hybridpar train` runs (the U-Net's dense
outputs: `train` refuses them without one; the first held-out run could not run those rows)."""

import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_validation
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return bench_validation


def test_holdout_groups_and_their_loss():
    b = _bench()
    doc = yaml.safe_load((ROOT / "benchmarks" / "holdout.yaml").read_text())["groups"]
    groups = b.holdout_groups()
    assert len(groups) == len(doc) and all(Path(m.split(":")[0]).is_file() for m, *_ in groups)
    extra = b.holdout_train_args()
    unet = next(m for m, *_ in groups if m.endswith("_holdout_models.py:unet_64"))
    assert extra[unet] == ["--loss", "cross_entropy"]
    # only the groups with the key get it
    assert len(extra) == sum(1 for g in doc if g.get("loss"))


def test_merged_rounds_take_the_median_skew_of_every_profile_call(tmp_path):
    """Each `hybridpar profile` call of a round re-measures the rank skew (and the collectives): the merged
    calibration holds the median over the calls, not the last call's (one call's 1.22 against 1.06-1.08
    put a whole run's predictions ~14% high)."""
    b = _bench()
    fit = {"kind": "allreduce", "world_size": 2, "group_size": 2, "intercept_s": 1e-3, "slope_s_per_byte": 1e-9,
           "max_rel_residual": 0.1}
    last = {"ops": {}, "rank_skew": {"2": 1.22}}
    calls = [{"collectives": [fit], "rank_skew": {"2": s}} for s in (1.06, 1.08, 1.05, 1.22)]
    target = tmp_path / "cal.json"
    b.merge_rounds([last], calls, target)
    import json

    merged = json.loads(target.read_text())
    assert merged["rank_skew"] == {"2": 1.07}
    assert merged["collectives"][0]["intercept_s"] == 1e-3


def test_merged_rounds_name_the_median_process_draw(tmp_path):
    """Each profile call scales the records it times by its own process draw; the merged file names the
    call at the median factor, not the last call's."""
    import json

    b = _bench()
    last = {"ops": {}, "process_draw": {"here_s": 1.0, "fresh_s": 1.28}}
    calls = [{"collectives": [], "rank_skew": {}, "process_draw": {"here_s": 1.0, "fresh_s": f}}
             for f in (0.97, 1.02, 1.28)]
    target = tmp_path / "cal.json"
    b.merge_rounds([last], calls, target)
    assert json.loads(target.read_text())["process_draw"] == {"here_s": 1.0, "fresh_s": 1.02}


def test_a_short_step_runs_for_at_least_min_seconds():
    """Ten steps of a 4 ms model are too few for a lower quartile: a run takes `--min-seconds` of steps
    after warm-up (capped), never fewer than `--steps`; 0 keeps `--steps` alone."""
    b = _bench()
    assert b._steps_for(12, 1.5, 0.004) == b.WARMUP_STEPS + 375
    assert b._steps_for(12, 1.5, 0.001) == 400  # the cap
    assert b._steps_for(12, 1.5, 0.35) == 12  # a long step: --steps already covers it
    assert b._steps_for(12, 0, 0.004) == 12 and b._steps_for(12, 1.5, None) == 12
