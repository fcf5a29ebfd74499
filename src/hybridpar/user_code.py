"""Running the user's own Python: a `file.py:factory` spec imported and called, every failure one line.

A user's file can raise anything on import, call sys.exit, or name a function it does not have; each is
a UserError (exit 2, one line) that names the file, never a traceback or the file's own exit status.
Used for model factories (hybridpar.graph.models) and data set factories (hybridpar.train.data.files).

User code is code: it runs with a time limit ($HYBRIDPAR_USER_CODE_TIMEOUT_S, default 600 s; 0 turns
the limit and the trial child off). In the process the user started (not in a rank), the import and
the factory first run in a forked trial child in its own process group, which is killed with
everything it started once it answers or its time is up: a factory that loops or sleeps past the
limit, or ends its process (`os._exit(0)`), is one line, exit 2, before anything else runs. Then it
runs here, under the same limit (SIGALRM, main thread only); children it leaves running are killed,
and the command line leaves without waiting for threads it started (cli/main.py). Anything printed
while it runs goes to stderr, so `--json` output stays JSON."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path

from hybridpar.errors import UserError
from hybridpar.procs import children

TIMEOUT_ENV = "HYBRIDPAR_USER_CODE_TIMEOUT_S"
TIMEOUT_DEFAULT_S = 600.0
_TRIED: set[tuple[str, int, str]] = set()


def time_limit_s() -> float:
    """The user-code time limit in seconds (0: none), from $HYBRIDPAR_USER_CODE_TIMEOUT_S."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return TIMEOUT_DEFAULT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (0 <= value < 1e7):  # also refuses nan and inf
        raise UserError(f"{TIMEOUT_ENV}={raw!r}: expected seconds, 0 (no limit) up to 1e7")
    return value


def call_factory(spec: str, default_fn: str, where: str, *, sep: str = ":"):
    """Import `path.py` of `spec` ("path.py:fn", or "path.py" for `default_fn`) and return fn()'s result.
    `where` starts every message (e.g. "model file", "--data x.py:ds")."""
    path_s, _, fn_name = spec.rpartition(":") if sep in spec else (spec, "", default_fn)
    fn_name = fn_name or default_fn
    path = Path(path_s)
    if not path.is_file():
        raise UserError(f"{where} {path_s!r} not found")
    limit = time_limit_s()
    key = (str(path.resolve()), path.stat().st_mtime_ns, fn_name)
    if limit and key not in _TRIED and _in_launcher():
        _trial(lambda: _import_and_call(path, path_s, fn_name, spec, where), spec, where, limit)
        _TRIED.add(key)  # a launcher builds the model several times (meta, whole): one trial is enough
    before = set(children(os.getpid()))
    try:
        with _stdout_to_stderr(), _alarm(limit, spec, where):
            return _import_and_call(path, path_s, fn_name, spec, where)
    finally:
        _kill_new_children(before, spec, where)


def _import_and_call(path: Path, path_s: str, fn_name: str, spec: str, where: str):
    mod_name = f"_hybridpar_user_{abs(hash(str(path.resolve())))}"
    try:
        mspec = importlib.util.spec_from_file_location(mod_name, path)
        if mspec is None or mspec.loader is None:
            raise UserError(f"{where}: cannot import {path_s!r} as Python")
        module = importlib.util.module_from_spec(mspec)
        sys.modules[mod_name] = module
        mspec.loader.exec_module(module)
    except (UserError, KeyboardInterrupt, _TimeUp):
        raise
    except SystemExit as err:  # a file that exits on import must not end a command with its status
        raise UserError(f"{where}: cannot import {path_s!r}: it called sys.exit({err.code})") from None
    except BaseException as err:  # noqa: BLE001 -- a user's file can raise anything, BaseException too
        raise UserError(f"{where}: cannot import {path_s!r}: {type(err).__name__}: {err}") from None
    factory = getattr(module, fn_name, None)
    if not callable(factory):
        raise UserError(f"{where}: {path_s!r} has no callable {fn_name!r}")
    try:
        return factory()
    except (UserError, KeyboardInterrupt, _TimeUp):
        raise
    except SystemExit as err:  # ... nor a factory that exits: an error, not the factory's exit status
        raise UserError(f"{where}: factory {spec!r} called sys.exit({err.code})") from None
    except BaseException as err:  # noqa: BLE001 -- so can their factory
        raise UserError(f"{where}: factory {spec!r} raised {type(err).__name__}: {err}") from None


# -- the trial child -------------------------------------------------------------------------------

def _in_launcher() -> bool:
    """True outside the ranks: a rank (torch.distributed initialised) or a loader worker has its
    launcher's trial behind it."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return False
    data = sys.modules.get("torch.utils.data")
    return not (data is not None and data.get_worker_info() is not None)


def _trial(run, spec: str, where: str, limit: float) -> None:
    """Run `run` in a forked child (own process group) for at most `limit` s: UserError if it ends its
    process or runs out of time. An exception in the child is not reported from there: the call here
    raises it again (and a child cannot do everything its parent can, e.g. initialise CUDA)."""
    if not hasattr(os, "fork"):
        return
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: report how `run` ended, then leave without the parent's teardown
        os.close(read)
        status = b"raised"
        try:
            os.setpgid(0, 0)
            _one_thread()
            with _stdout_to_stderr():
                run()
            status = b"ok"
        except BaseException:  # noqa: BLE001, S110 -- any failure is raised again in the parent
            pass
        with contextlib.suppress(OSError):
            os.write(write, status)
        os._exit(0)
    os.close(write)
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)  # also here: no window in which the child is in our group
    try:
        ready, _, _ = select.select([read], [], [], limit)
        answer = os.read(read, 16) if ready else None
    finally:
        os.close(read)
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)  # the child and everything it started
        _, wstatus = os.waitpid(pid, 0)
    if answer is None:
        raise UserError(f"{where}: {spec!r} did not finish within {limit:g} s ({TIMEOUT_ENV})")
    if not answer:  # the pipe closed without an answer: the code ended its process
        code = os.waitstatus_to_exitcode(wstatus)
        how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        raise UserError(f"{where}: {spec!r} ended its process ({how}) instead of returning")


def _one_thread() -> None:
    torch = sys.modules.get("torch")
    if torch is not None:  # OpenMP's thread pool does not survive a fork
        torch.set_num_threads(1)


# -- limits in this process ------------------------------------------------------------------------

class _TimeUp(BaseException):
    """Raised by the alarm; a BaseException so the user's `except Exception` cannot swallow it."""


@contextlib.contextmanager
def _alarm(limit: float, spec: str, where: str):
    if (not limit or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer")
            or signal.getitimer(signal.ITIMER_REAL)[0] > 0):  # a timer already set (pytest-timeout) is kept
        yield
        return

    def fire(_sig, _frame):
        raise _TimeUp

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    except _TimeUp:
        raise UserError(f"{where}: {spec!r} did not finish within {limit:g} s ({TIMEOUT_ENV})") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def _stdout_to_stderr():
    """File descriptor 1 (and sys.stdout) point at stderr: what user code prints never mixes into
    our stdout (`--json`)."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no fd 1 at all
        yield
        return
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _kill_new_children(before: set[int], spec: str, where: str) -> None:
    """Processes the user's code started and left running are killed: nothing but the returned object
    is meant to outlive the call, and a stray fork would hold the launcher's output open."""
    strays = set(children(os.getpid())) - before
    for pid in strays:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    for pid in strays:
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    time.sleep(0.01)
                    continue
            break
    if strays:
        print(f"hybridpar: warning: {where} {spec!r} left {len(strays)} process(es) running; killed them",
              file=sys.stderr)
