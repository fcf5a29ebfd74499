"""DataConfig: the `[data]` section of a run, what the loader reads and how."""

from __future__ import annotations

from dataclasses import dataclass

from hybridpar.errors import UserError
from hybridpar.train.checks import check_counts


@dataclass(frozen=True)
class DataConfig:
    """`source`: synthetic | digits | path.pt | path.npy | an image folder | file.py:factory (the
    `--data` flag). `synthetic_size`: samples of the synthetic set. `shuffle`: a new order each epoch
    (False: step i reads samples i*B .. (i+1)*B-1 in file order). `workers`: loader processes per rank
    (None: loader.default_workers). `local_ranks`: ranks sharing this machine (None: all), to share its
    cores among their loaders."""

    source: str = "synthetic"
    synthetic_size: int = 1024
    shuffle: bool = True
    workers: int | None = None
    local_ranks: int | None = None

    def check(self) -> None:
        """UserError (with `param`) for a setting no loader can take."""
        check_counts(synthetic_size=self.synthetic_size)
        w = self.workers
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
            raise UserError(f"workers must be an integer >= 0, got {w!r}", param="workers")
