"""benchmarks/run_all.py: every bench in its own subprocess with a timeout, one summary."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

BENCHES = {
    "bench_good.py": "import json, os\njson.dump({'ddp_ratio': 1.25, 'rows': [1, 2]}, "
                     "open(os.environ['HYBRIDPAR_BENCH_OUT'], 'w'))\nprint('good')\n",
    "bench_crash.py": "raise SystemExit('boom: no cluster')\n",
    "bench_hang.py": "import time\ntime.sleep(600)\n",
    "bench_silent.py": "print('forgot the json')\n",
}


@pytest.mark.timeout(120)
def test_run_all_summarises_every_outcome(tmp_path):
    bench_dir, out_dir = tmp_path / "b", tmp_path / "out"
    bench_dir.mkdir()
    for name, code in BENCHES.items():
        (bench_dir / name).write_text(code)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/run_all.py"), "--bench-dir", str(bench_dir),
                           "--out-dir", str(out_dir), "--timeout", "3", "--no-report"],
                          capture_output=True, text=True, timeout=100, check=False)
    assert proc.returncode == 1  # some failed
    summary = json.loads((out_dir / "summary.json").read_text())
    status = {b["name"]: b["status"] for b in summary["benchmarks"]}
    assert status == {"crash": "failed", "good": "ok", "hang": "timeout", "silent": "no-json"}
    good = next(b for b in summary["benchmarks"] if b["name"] == "good")
    assert good["result"]["ddp_ratio"] == 1.25
    md = (out_dir / "summary.md").read_text()
    assert "| good | ok |" in md and "ddp_ratio = 1.25" in md and "boom: no cluster" in md
