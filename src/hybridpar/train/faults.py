"""Rank failures: collective timeouts, a clear error for a lost peer, and a test-only fault injector.

Under `torchrun --max-restarts R` a rank that dies makes the elastic agent stop the other ranks and
start the whole group again; the train loop then resumes from the last complete checkpoint. What
must never happen is a hang: every process group gets a timeout (HYBRIDPAR_COLLECTIVE_TIMEOUT_S,
default 300 s), and gloo reports a closed peer connection at once.
"""

from __future__ import annotations

import contextlib
import os
import sys
from datetime import timedelta

import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "HYBRIDPAR_COLLECTIVE_TIMEOUT_S"
# Test-only fault injection: rank FAIL_RANK exits abruptly before step FAIL_STEP, on the first attempt.
FAIL_RANK_ENV, FAIL_STEP_ENV = "HYBRIDPAR_TEST_FAIL_RANK", "HYBRIDPAR_TEST_FAIL_STEP"
# Test-only: every rank of a process with this variable waits before this step on the first attempt
# (a node to be killed while its peers wait for it in a collective: tests/hardening/test_two_nodes.py).
PAUSE_STEP_ENV = "HYBRIDPAR_TEST_PAUSE_STEP"
FAIL_EXIT_CODE = 17


class RankFailure(RuntimeError):
    """A peer rank was lost (killed, crashed or unreachable) during a collective."""


MIN_TIMEOUT_S, MAX_TIMEOUT_S = 0.1, 1e6  # gloo rounds below a millisecond to none; timedelta overflows


def collective_timeout() -> timedelta:
    """$HYBRIDPAR_COLLECTIVE_TIMEOUT_S (default 300 s); UserError for a value that is not a number of
    seconds in [0.1, 1e6] (junk used to become 300 s silently, `inf` and `1e-9` failed inside the ranks).
    The launcher calls it before any rank starts."""
    from hybridpar.errors import UserError

    raw = (os.environ.get(TIMEOUT_ENV) or "").strip()
    if not raw:
        return timedelta(seconds=DEFAULT_TIMEOUT_S)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not MIN_TIMEOUT_S <= seconds <= MAX_TIMEOUT_S:  # also refuses nan and inf
        raise UserError(f"{TIMEOUT_ENV}={raw!r}: expected seconds from {MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:g}")
    return timedelta(seconds=seconds)


def set_default_timeout() -> timedelta:
    """Make `collective_timeout()` the default of every process group created from now on, subgroups
    (dist.new_group) included: torch fills a missing timeout from this module-level default (30 min)."""
    import torch.distributed.distributed_c10d as c10d

    timeout = collective_timeout()
    c10d.default_pg_timeout = timeout
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), timedelta):
        c10d.default_pg_nccl_timeout = timeout
    return timeout


ATTEMPT_ENV = "HYBRIDPAR_ATTEMPT"  # set by launch.init: the attempt every node's ranks agree on


def restart_count() -> int:
    """How many times torchrun has restarted this worker group (0 on the first attempt): the attempt
    launch.init counted in the store once the rank joined (torchrun's own count differs between nodes:
    a node whose ranks did not fail restarts them for the new round without counting a restart)."""
    try:
        return max(int(os.environ.get(ATTEMPT_ENV) or 0), int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0))
    except ValueError:
        return 0


def maybe_inject_failure(step: int) -> None:
    """Exit this rank abruptly (no cleanup, like a kill) if the test-only variables select it."""
    rank_s, step_s = os.environ.get(FAIL_RANK_ENV), os.environ.get(FAIL_STEP_ENV)
    if rank_s is None or step_s is None or restart_count() > 0:
        return
    if dist.is_initialized() and dist.get_rank() == int(rank_s) and step == int(step_s):
        print(f"hybridpar: test fault: rank {rank_s} exits at step {step}", file=sys.stderr, flush=True)
        os._exit(FAIL_EXIT_CODE)


def maybe_pause(step: int) -> None:
    """Wait (up to 10 minutes) before `step` if the test-only variable selects it, on the first attempt."""
    step_s = os.environ.get(PAUSE_STEP_ENV)
    if step_s is None or restart_count() > 0 or step != int(step_s):
        return
    import time

    print(f"hybridpar: test pause before step {step}", file=sys.stderr, flush=True)
    time.sleep(600)


def is_peer_loss(err: BaseException) -> bool:
    """Whether a collective's error means a peer went away (as opposed to a bug in this rank)."""
    text = str(err).lower()
    return isinstance(err, (dist.DistBackendError, ConnectionError, TimeoutError)) or any(
        w in text for w in ("connection reset", "connection closed", "broken pipe", "timed out", "timeout",
                            "peer", "gloo"))


@contextlib.contextmanager
def peer_loss_at(step: int):
    """A collective's error meaning a lost peer, inside the block, becomes peer_loss_error's one line
    (never a raw gloo error or a hang: timeouts in launch)."""
    try:
        yield
    except RuntimeError as err:
        raise (peer_loss_error(err, step) if is_peer_loss(err) else err) from err


def peer_loss_error(err: BaseException, step: int) -> RankFailure:
    rank = dist.get_rank() if dist.is_initialized() else "?"
    first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
    hint = ("torchrun will restart the group from the last checkpoint" if "TORCHELASTIC_RUN_ID" in os.environ
            else "rerun with --resume to continue from the last checkpoint")
    return RankFailure(f"rank {rank} lost a peer at step {step} ({first}); {hint}")
