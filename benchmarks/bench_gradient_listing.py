"""The planner's gradient bytes and parameter listing on every Hugging Face image-classification family
(issue 13 item 1): `hybridpar plan --strategy sample=2 --gpus 2 --json` on each family's tiny model
(tests/conformance's shrink rule), its predicted gradient allreduce (`breakdown.grad_bytes`) against
4 bytes x the model's trainable parameters (what a sample-only step allreduces), and the `parameters`
listing's elements against the same count. Offline; ~4 s per family.

    HF_HUB_OFFLINE=1 python benchmarks/bench_gradient_listing.py [FAMILY ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "conformance"))

import hf_families  # noqa: E402 - the conformance suite's families (tests/conformance on sys.path)
from train_checks import BATCH, cli, train_spec  # noqa: E402


def main(names: list[str]) -> None:
    exact = 0
    names = names or hf_families.family_names()
    for name in names:
        try:
            model = hf_families.tiny_family(name).build()
        except Exception as err:  # noqa: BLE001 - the suite's skipped families (missing packages, configs)
            print(f"{name:24} skipped: {type(err).__name__}: {str(err)[:60]}")
            continue
        want = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
        rc, out, err = cli(["plan", "--model", train_spec(name), "--cluster", "localhost", "--strategy", "sample=2",
                            "--gpus", "2", "--batch", str(BATCH), "--json", "--no-dry-run"])
        if rc != 0:
            print(f"{name:24} plan failed: {err.strip()[-100:]}")
            continue
        d = json.loads(out)
        got, listed = d["breakdown"]["grad_bytes"], 4 * sum(r["numel"] for r in d["parameters"])
        exact += got == want == listed
        print(f"{name:24} predicted {got:>11,} B  4 x params {want:>11,} B  {100 * (got - want) / want:+.2f}%  "
              f"listed {listed:>11,} B  {len(d['parameters'])} entries")
    print(f"{exact} of {len(names)} families: predicted == listed == 4 x trainable parameters")


if __name__ == "__main__":
    main(sys.argv[1:])
