"""User-facing errors: the CLI turns these into one line on stderr and exit code 2."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user (unknown model, malformed file, bad option). Never a traceback.

    The library words its messages in its own terms. When a message is about one argument, it starts
    with the argument's Python name and `param` names it (`UserError("gpus must be >= 1, got 0",
    param="gpus")`); the command line shows that name as its flag (`--gpus must be >= 1, got 0`)."""

    def __init__(self, message: str = "", *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InfeasibleError(UserError):
    """The request cannot be satisfied (e.g. a model that fits no device), with the bottleneck named."""
