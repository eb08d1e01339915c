"""`marinctl plan RECIPE`: what a user checks before launching — sizes, FLOPs, LRs, capacities, memory.

Pure arithmetic over the recipe (no JAX import, runs in well under a second for the hero), using the
same core functions the trainer uses, so the plan cannot drift from the run.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import typer
from rich.table import Table

from marinctl.counting import capacity, count_params, flops_per_token, memory_estimate
from marinctl.errors import UserError
from marinctl.hparams import hyperparams
from marinctl.params import recipe_device_count, resolve_mesh_shape
from marinctl.recipe import Recipe
from marinctl.stage import JsonOpt, QuietOpt, RecipeArg, SetOpt, Stage, VerboseOpt, console, emit_json, open_recipe

GiB = 2**30


def plan_summary(recipe: Recipe, devices: int | None = None) -> dict[str, Any]:
    """Everything `plan` reports, as one JSON-able dict (the `--json` contract)."""
    from marinctl.optim.groups import group_sizes  # here: marinctl.optim imports JAX, which `--help` need not

    n_dev = devices or recipe_device_count(recipe.parallel) or 1
    try:
        mesh = resolve_mesh_shape(recipe.parallel, n_dev)
    except ValueError as err:
        raise UserError(f"{recipe.source}: parallel: {err}") from None
    counts = count_params(recipe)
    flops = flops_per_token(recipe)
    hp = hyperparams(recipe)
    tokens = recipe.total_tokens
    shards = math.prod(mesh.values())
    tokens_per_shard = recipe.tokens_per_step // (shards * recipe.train.grad_accum)
    cap = capacity(recipe, tokens_per_shard, mesh["expert"])
    mem = memory_estimate(recipe, mesh)
    groups = group_sizes(recipe)
    return {
        "recipe": recipe.name,
        "total_params": counts.total,
        "matmul_params": counts.matmul,
        "active_params": counts.active,
        "components": counts.components,
        "optimizer_groups": groups,
        "flops_per_token": flops.per_token,
        "flops_per_token_causal": flops.per_token_causal,
        "flops_convention": "recipe §7: full-square attention, lm_head included; causal = MaxText halved attention",
        "train_flops": flops.train(tokens),
        "train_flops_excl_lm_head": flops.train(tokens, lm_head=False),
        "tokens_per_step": recipe.tokens_per_step,
        "steps": recipe.train.steps,
        "tokens": tokens,
        "warmup_steps": hp.warmup_steps,
        "adam_lr": hp.adam_lr,
        "muonh_lr": hp.muonh_lr,
        "adamh_lr": hp.adamh_lr,
        "beta1": hp.beta1,
        "beta2": hp.beta2,
        "epsilon": hp.epsilon,
        "mesh": mesh,
        "devices": shards,
        "capacity": {**cap.as_dict(), "transport": recipe.moe.transport, "capacity_factor": recipe.moe.capacity_factor},
        "memory_per_device": mem.as_dict(),
    }


def _fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:g}"


def render(summary: dict[str, Any]) -> list[Table]:
    main = Table(title=f"marinctl plan — {summary['recipe']}", show_header=True, header_style="bold")
    main.add_column("quantity")
    main.add_column("value", justify="right")
    main.add_column("note")
    rows = [
        ("total parameters", _fmt_count(summary["total_params"]), f"{summary['total_params']:,} (every leaf)"),
        ("matmul parameters", _fmt_count(summary["matmul_params"]), "hyperball matrices + embedding"),
        ("active parameters", _fmt_count(summary["active_params"]), "per token, docs/recipe.md §1 formula"),
        ("forward FLOPs/token", f"{summary['flops_per_token']:.4g}", "docs/recipe.md §7 (full-square attention)"),
        ("forward FLOPs/token", f"{summary['flops_per_token_causal']:.4g}", "MaxText (causal-halved attention)"),
        ("training FLOPs", f"{summary['train_flops']:.3e}", "3 x f x tokens, lm_head included"),
        ("training FLOPs", f"{summary['train_flops_excl_lm_head']:.3e}", "excluding lm_head (ladder C)"),
        ("tokens / step", f"{summary['tokens_per_step']:,}", ""),
        ("steps", f"{summary['steps']:,}", ""),
        ("total tokens", _fmt_count(summary["tokens"]), f"{summary['tokens']:,}"),
        ("warmup steps", f"{summary['warmup_steps']:,}", "then linear decay to the final fraction"),
        ("Adam LR", f"{summary['adam_lr']:.4g}", "embedding, router, gate, gains, SConv"),
        ("MuonH LR", f"{summary['muonh_lr']:.4g}", "matrices"),
        ("AdamH LR", f"{summary['adamh_lr']:.4g}", "lm_head"),
        ("β1 / β2", f"{summary['beta1']:.4g} / {summary['beta2']:.4g}", ""),
        ("ε", f"{summary['epsilon']:.4g}", ""),
    ]
    for row in rows:
        main.add_row(*row)

    parts = Table(title="parameters by component / optimizer group", header_style="bold")
    parts.add_column("component")
    parts.add_column("params", justify="right")
    for name, n in sorted(summary["components"].items(), key=lambda kv: -kv[1]):
        parts.add_row(name, _fmt_count(n))
    for name, n in summary["optimizer_groups"].items():
        parts.add_row(f"[dim]group[/dim] {name}", _fmt_count(n))

    mesh, cap = summary["mesh"], summary["capacity"]
    par = Table(
        title=f"mesh {' x '.join(f'{k}={v}' for k, v in mesh.items())} ({summary['devices']} devices)",
        header_style="bold",
    )
    par.add_column("expert parallelism")
    par.add_column("value", justify="right")
    par.add_row("transport", f"{cap['transport']} (cf {cap['capacity_factor']:g})")
    par.add_row("tokens per shard T", f"{cap['tokens_per_shard']:,}")
    par.add_row("expert shards S / experts per shard", f"{cap['expert_shards']} / {cap['experts_per_shard']}")
    par.add_row("assignments per shard A", f"{cap['assignments']:,}")
    par.add_row("fixed all-to-all cell capacity", f"{cap['fixed_cell']:,}")
    par.add_row(f"pooled sender pool P ({cap['waves']} waves)", f"{cap['pooled_sender']:,}")
    par.add_row("pooled receiver buffer R", f"{cap['pooled_receiver']:,}")
    par.add_row("ragged receive buffer", f"{cap['ragged_receiver']:,}")
    mem = summary["memory_per_device"]
    for key, value in mem["parts"].items():
        if value:  # components of phases that are not the peak read 0
            par.add_row(f"memory: {key}", f"{value / GiB:,.2f} GiB")
    par.add_row(f"memory: total ({mem['peak_phase']} peak)", f"{mem['total'] / GiB:,.2f} GiB")
    for key, value in mem["host"].items():
        if value:  # model.remat = "offload": kept in the host's pinned memory, not in the total
            par.add_row(f"host memory: {key}", f"{value / GiB:,.2f} GiB")
    return [main, parts, par]


def plan(
    recipe_path: RecipeArg,
    overrides: SetOpt = None,
    devices: Annotated[
        int | None, typer.Option("--devices", help="Devices to plan for when the recipe's mesh has a -1 axis.")
    ] = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Show parameters, FLOPs, tokens, learning rates, EP capacities and per-device memory of a recipe."""
    recipe = open_recipe(recipe_path, overrides)
    summary = plan_summary(recipe, devices)
    if as_json:
        emit_json(summary)
    if (not as_json and not quiet) or verbose:  # with --json the tables only appear on request (-v)
        out = console()
        for table in render(summary):
            out.print(table)


stage = Stage(name="plan", help="Show sizes, FLOPs, LRs, EP capacities and memory of a recipe.", command=plan)
