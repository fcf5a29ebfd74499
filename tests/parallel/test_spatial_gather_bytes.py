"""Adaptive pools under spatial layouts priced where the runtime sends their bytes (issue 35's
held-out run: CosmoFlow under depth=2 logged 16,384 bytes of allgather that `plan` did not predict):
`hybridpar plan --strategy depth=2 --json` (and width=2) predicts per kind exactly the bytes a
training step sends, on rank 0, whose pieces are the largest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridpar.cli.main import main
from hybridpar.train.launch import spawn

from ._spatial_gather_bytes_workers import BATCH, SHAPES, step_bytes

WORKERS = Path(__file__).with_name("_spatial_gather_bytes_workers.py")
CASES = [("cosmo_tiny", "depth=2"), ("pool_strip", "width=2")]


def _predicted(capsys, factory: str, strategy: str) -> dict[str, int]:
    shape = ",".join(map(str, SHAPES[factory]))
    code = main(["plan", "--model", f"{WORKERS}:{factory}", "--input-shape", shape, "--batch", str(BATCH),
                 "--gpus", "2", "--cluster", "localhost", "--strategy", strategy, "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)["predicted"]["comm_bytes"]


@pytest.mark.slow
def test_plan_predicts_the_bytes_of_gathered_adaptive_pools(capsys):
    sent = spawn(step_bytes, 2, CASES)
    for (factory, strategy), ranks in zip(CASES, sent):
        predicted = _predicted(capsys, factory, strategy)
        assert predicted == ranks[0], (factory, strategy, predicted, ranks[0])
        assert predicted["allgather"] > 0 and predicted["halo"] > 0
