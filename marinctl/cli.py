"""The `marinctl` command: discovers stages from the `marinctl.stages` entry points and runs them.

Exit codes (documented for schedulers): 0 done, 1 crash, 2 user error, 3 preempted and checkpointed.
"""

from __future__ import annotations

import logging
import sys
from importlib.metadata import entry_points
from typing import Annotated

import typer

from marinctl import __version__
from marinctl.errors import UserError
from marinctl.stage import Stage

log = logging.getLogger("marinctl")


def _version(value: bool) -> None:
    if value:
        print(f"marinctl {__version__}")
        raise typer.Exit()


def build_app() -> typer.Typer:
    app = typer.Typer(
        name="marinctl",
        help="Reproduce the Marin 535B-A23B pretraining recipe: plan, tokenize, train, evaluate, export.",
        no_args_is_help=True,
        add_completion=True,
        pretty_exceptions_enable=False,
        rich_markup_mode="rich",
    )

    @app.callback()
    def _root(
        version: Annotated[
            bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
        ] = False,
    ) -> None:
        """Exit codes: 0 done, 1 crash, 2 user error, 3 preempted (checkpointed; requeue)."""

    for stage in discover_stages():
        if stage.group is not None:
            app.add_typer(stage.group, name=stage.name, help=stage.help)
        else:
            app.command(name=stage.name, help=stage.help)(stage.command)
    return app


def discover_stages() -> list[Stage]:
    stages: dict[str, Stage] = {}
    for ep in sorted(entry_points(group="marinctl.stages"), key=lambda e: e.name):
        if ep.name in stages:
            continue  # first registration wins; a plugin cannot silently replace a core stage
        try:
            obj = ep.load()
        except Exception as err:  # a broken plugin must not take the whole CLI down
            print(f"marinctl: warning: stage {ep.name!r} ({ep.value}) failed to load: {err}", file=sys.stderr)
            continue
        if not isinstance(obj, Stage):
            print(f"marinctl: warning: entry point {ep.name!r} is not a marinctl Stage", file=sys.stderr)
            continue
        stages[ep.name] = obj
    return list(stages.values())


def run(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code (tests call this; `main` exits with it).

    Usage errors are click's (exit 2, its usage message); `UserError` from a stage prints its one line
    and exits 2; anything else is a crash with a traceback (exit 1).
    """
    command = typer.main.get_command(build_app())
    try:
        command.main(args=argv, prog_name="marinctl", standalone_mode=True)
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except UserError as err:
        print(str(err), file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("marinctl: interrupted", file=sys.stderr)
        return 130
    return 0


def main() -> None:
    from marinctl.runtime import exec_with_host_heap

    exec_with_host_heap()  # before anything runs: glibc reads its malloc tunables only at process start
    sys.exit(run())


if __name__ == "__main__":
    main()
