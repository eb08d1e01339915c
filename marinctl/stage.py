"""What a stage is, and the options every stage shares.

A stage is a `Stage` object exposed under the `marinctl.stages` entry-point group; the CLI discovers
them at start-up, so another package can add a subcommand by declaring one entry point. Stage modules
keep JAX imports inside their command so `marinctl --help` stays instant and `[runtime]` settings can
be applied before JAX starts.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from marinctl.recipe import Recipe, load_recipe


@dataclass(frozen=True)
class Stage:
    name: str
    help: str
    command: Callable[..., Any]
    # Extra typer.Typer to mount instead of a single command (for stages with sub-commands).
    group: typer.Typer | None = None


RecipeArg = Annotated[Path, typer.Argument(help="Recipe TOML file.", show_default=False)]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a recipe value: section.key=value (repeatable, typed by the schema)."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one machine-readable JSON object on stdout.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Only errors and the final result.")]
VerboseOpt = Annotated[int, typer.Option("--verbose", "-v", count=True, help="More detail (repeatable).")]


def console() -> Console:
    """Human output goes to stderr so `--json` stdout stays parseable; rich honours NO_COLOR itself."""
    return Console(stderr=True, no_color=bool(os.environ.get("NO_COLOR")) or None, highlight=False)


def setup_logging(quiet: bool, verbose: int) -> None:
    level = logging.WARNING - 10 * min(verbose, 2)
    if quiet:
        level = logging.ERROR
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr, force=True)
    for noisy in ("absl", "jax._src", "orbax", "etils"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))


def open_recipe(path: Path, overrides: list[str] | None) -> Recipe:
    """Load and validate a recipe, then apply its `[runtime]` environment before anything imports JAX."""
    from marinctl.runtime import apply_runtime

    recipe = load_recipe(path, overrides or ())
    apply_runtime(recipe.runtime)
    return recipe


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=None, sort_keys=False, default=_json_default) + "\n")
    sys.stdout.flush()


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")
