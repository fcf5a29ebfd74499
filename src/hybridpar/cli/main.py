"""`hybridpar` command line. Each module in hybridpar.cli.commands defines `register(app)`;
they are discovered here so that adding a command never edits a shared file."""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys

import click

from hybridpar.errors import UserError


class _Commands(click.Group):
    """The command modules, imported when needed: running `hybridpar plan` imports the module named
    for the command (hybridpar.cli.commands.plan) and no other command's (their imports cost a
    planner run ~10%); listing the commands, or a name no module is named for (an alias), imports
    them all."""

    _loaded: set[str]

    def _load(self, names) -> None:
        for name in names:
            if name not in self._loaded:
                self._loaded.add(name)
                mod = importlib.import_module(f"hybridpar.cli.commands.{name}")
                if hasattr(mod, "register"):
                    mod.register(self)

    def _modules(self) -> list[str]:
        from hybridpar.cli import commands

        return sorted(m.name for m in pkgutil.iter_modules(commands.__path__))

    def get_command(self, ctx, cmd_name):
        if cmd_name not in self.commands:
            mod = cmd_name.replace("-", "_")
            self._load([mod] if mod in self._modules() else [])
        if cmd_name not in self.commands:
            self._load(self._modules())
        return super().get_command(ctx, cmd_name)

    def list_commands(self, ctx):
        self._load(self._modules())
        return super().list_commands(ctx)


def build_app(lazy: bool = False) -> click.Group:
    """The `hybridpar` group; `lazy`: command modules imported when a command is asked for (the
    console script), else all at once (`.commands` complete)."""

    @click.group(name="hybridpar", cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
    @click.version_option(package_name="hybridpar")
    def app() -> None:
        """Plan and run hybrid-parallel (data x model x channel/filter) deep-learning training."""

    app._loaded = set()
    if not lazy:
        app._load(app._modules())
    return app


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())


# Library argument names whose flag is not the name with dashes.
_FLAG_OF = {"time_limit_s": "--time-limit", "devices": "--gpus"}


def in_flags(err: UserError) -> str:
    """The library's message with the argument it is about (`err.param`) named as its flag, and every
    other argument it names in backquotes (`profile_steps`) too."""
    import re

    msg = str(err)
    if err.param and msg.startswith(err.param):
        msg = _FLAG_OF.get(err.param, "--" + err.param.replace("_", "-")) + msg[len(err.param):]
    return re.sub(r"`([a-z][a-z0-9_]*)`", lambda m: _FLAG_OF.get(m[1], "--" + m[1].replace("_", "-")), msg)


def main(argv: list[str] | None = None) -> int:
    app = build_app(lazy=True)
    try:
        rv = app.main(args=argv, prog_name="hybridpar", standalone_mode=False)
        if isinstance(rv, int) and rv:
            return _exit(rv, argv)
    except UserError as err:
        print(f"hybridpar: error: {_one_line(in_flags(err))}", file=sys.stderr)
        return _exit(2, argv)
    except click.exceptions.UsageError as err:
        print(f"hybridpar: error: {_one_line(err.format_message())}", file=sys.stderr)
        return _exit(2, argv)
    except click.exceptions.Exit as err:
        return _exit(err.exit_code, argv)
    except click.exceptions.Abort:
        print("hybridpar: aborted", file=sys.stderr)
        return _exit(130, argv)
    except KeyboardInterrupt:
        print("hybridpar: interrupted", file=sys.stderr)
        return _exit(130, argv)
    return _exit(0, argv)


def _exit(code: int, argv: list[str] | None) -> int:
    # As a console script we exit; called from Python (tests) we return the code.
    if argv is None:
        launch = sys.modules.get("hybridpar.train.launch")  # imported only by commands that train
        if launch is not None and launch.joined_launcher():
            # A torchrun rank leaves without the interpreter's teardown, as spawned ranks do (launch.py):
            # gloo's C++ objects can abort there ("terminate called without an active exception", seen
            # after a finished, restarted 2-rank run), and torchrun would call the finished run failed.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        if _stray_threads():
            # a user's model or data file started a thread that never ends: the interpreter's exit
            # would wait for it forever (user_code.py); the command's work is done
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        sys.exit(code)
    return code


def _stray_threads() -> bool:
    import threading

    return any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread())


if __name__ == "__main__":
    main()
