"""benchmarks/bench_micro_batches.py --1f1b --quick: the 1F1B-against-no-pipelining comparison runs end to
end (placer asked for 1f1b, both paths measured, predictions beside them), so the lead's quiet-machine run
cannot rot. Its figures are not checked: a loaded machine's timings are not the speed-up."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_1f1b_comparison_quick_run():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_micro_batches.py"), "--1f1b", "--quick"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["placer_schedule"] == "1f1b" and out["placer_micro_batches"] >= 2
    assert set(out["measured_median_step_s"]) == set(out["predicted_step_s"]) == {"k1", "1f1b"}
    assert all(v > 0 for v in out["measured_median_step_s"].values())
    # every timed and warm-up step of the 1f1b path ran through torch's Schedule1F1B
    assert out["torch_1f1b_steps"] == out["steps_each"] + 2
