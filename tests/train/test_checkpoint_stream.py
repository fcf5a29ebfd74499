"""--init-from and a resume read only this rank's own pieces (bytes counted by the loader,
hybridpar.train.checkpoint.READ_BYTES), and give the weights and momentum that were saved."""

from __future__ import annotations

from tests.parallel import _materialize_workers as w

from hybridpar.train.launch import spawn


def test_init_from_and_resume_read_only_own_pieces(tmp_path):
    rows = spawn(w.reads_own_pieces, 2, str(tmp_path))
    whole = rows[0]["whole"]
    for r in rows:
        assert r["same"] and r["same_after_step"], r
        assert r["init_read"] == r["own"] < whole, r  # channel=2: a piece of each split layer
        assert r["weights_read"] == r["own"], r
        assert r["momentum_read"] == r["own_params"], r
