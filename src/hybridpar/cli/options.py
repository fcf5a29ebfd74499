"""The options every command spells the same way: device count, cluster and batch.

One vocabulary across `plan`, `place`, `project`, `train` and `report`:

- `--gpus N`: devices (ranks) of the run, an integer; `project` sweeps a comma-separated list of
  them. Default 2 where a command needs a count and nothing else gives one (`train` takes the
  plan's world size or the strategy's).
- `--cluster C`: a preset name or a cluster file, default `localhost` (this machine, measured by
  `hybridpar profile`) everywhere.
- `--batch B`: the global batch, samples per optimizer step over all devices, default 32. A batch per
  data-parallel worker (the projection's weak scaling) is `--batch-per-gpu`.
- `--optimizer sgd|adamw|lars` with `--momentum` and `--weight-decay`: what the run steps with, in
  `train`'s words wherever a command prices or runs it (`plan`, `place`, `train`; `project` prices
  momentum SGD). `place` also accepts the cost model's old names, `momentum` (= sgd with momentum)
  and `adam`.

Old spellings stay accepted as hidden aliases (`place --devices`, `train --nproc`, also as `nproc` in a
`train --config` file), so existing scripts keep working; `--help` shows only the names above.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import click

DEFAULT_CLUSTER = "localhost"
DEFAULT_BATCH = 32
DEFAULT_GPUS = 2


class AliasedOption(click.Option):
    """A click option with extra names that parse like the main one but are left out of --help."""

    def __init__(self, param_decls: Sequence[str], *, hidden_aliases: Sequence[str] = (), **kwargs):
        super().__init__([*param_decls, *hidden_aliases], **kwargs)
        self.hidden_aliases = tuple(hidden_aliases)

    def get_help_record(self, ctx: click.Context):
        opts, secondary = self.opts, self.secondary_opts
        self.opts = [o for o in opts if o not in self.hidden_aliases]
        self.secondary_opts = [o for o in secondary if o not in self.hidden_aliases]
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts, self.secondary_opts = opts, secondary


def gpus_option(*, default: int | None = DEFAULT_GPUS, aliases: Sequence[str] = (), help: str | None = None):
    """`--gpus N`: an integer device count (the library checks its range and names the flag)."""
    return click.option("--gpus", "gpus", cls=AliasedOption, hidden_aliases=aliases, type=int, default=default,
                        show_default=default is not None, metavar="N",
                        help=help or "devices (ranks) of the run")


def gpus_list_option(*, default: str, aliases: Sequence[str] = (), help: str | None = None):
    """`--gpus N,N,...`: device counts to sweep (parsed with hybridpar.cli.parsing.parse_int_list)."""
    return click.option("--gpus", "gpus", cls=AliasedOption, hidden_aliases=aliases, default=default,
                        show_default=True, metavar="N[,N...]",
                        help=help or "device counts, comma-separated")


def cluster_option(*, aliases: Sequence[str] = (), help: str | None = None):
    """`--cluster C`: preset name or cluster file, default localhost."""
    return click.option("--cluster", "cluster", cls=AliasedOption, hidden_aliases=aliases, default=DEFAULT_CLUSTER,
                        show_default=True, metavar="C",
                        help=help or "cluster preset (hybridpar clusters) or cluster YAML file")


def batch_option(*, default: int | None = DEFAULT_BATCH, aliases: Sequence[str] = (), help: str | None = None):
    """`--batch B`: the global batch (samples per optimizer step over all devices)."""
    return click.option("--batch", "batch", cls=AliasedOption, hidden_aliases=aliases, type=int, default=default,
                        show_default=default is not None, metavar="B",
                        help=help or "global batch: samples per step over all devices")


class PositiveFloat(click.ParamType):
    """A finite number > 0 (NaN, Inf, zero and negatives are a usage error: one line, exit 2)."""

    name = "float"

    def convert(self, value, param, ctx):
        if isinstance(value, float) and math.isfinite(value) and value > 0:
            return value
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(number) or number <= 0:
            self.fail(f"{value!r} must be a finite number > 0", param, ctx)
        return number


POSITIVE_FLOAT = PositiveFloat()
