"""User-facing errors: the CLI turns these into one line on stderr and exit code 2."""


class UserError(Exception):
    """Bad input from the user (unknown model, malformed file, bad option). Never a traceback."""


class InfeasibleError(UserError):
    """The request cannot be satisfied (e.g. a model that fits no device), with the bottleneck named."""
