"""Parameter groups of the hyperball optimizer (docs/recipe.md §5): which leaf trains with Adam, AdamH or MuonH.

The rule list below is docs/recipe.md §5's table read top to bottom (first match wins), applied to dotted leaf
paths, so it labels any tree shaped like the model (parameters, gradients, abstract shapes). The
parameter table (`marinctl.params.param_table`) records the same group per leaf for the planner;
`build_optimizer` refuses to run if the two ever disagree.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

from marinctl.optim.hyperball import frobenius_norm
from marinctl.params import MATRIX_BATCH_AXES, NORM_KEEP_AXES, Group, ParamSpec, param_table, tree_paths
from marinctl.recipe import Recipe

GROUPS: tuple[Group, ...] = ("adam", "adamh", "muonh")

# (pattern on the dotted path, group); first match wins, as in docs/recipe.md §5.
GROUP_RULES: tuple[tuple[str, Group], ...] = (
    # The embedding stays outside hyperball: under AdamH its gradient norm spiked (the post, Figure 5).
    (r"^embed\.weight$", "adam"),
    # The router (and its bias, were it ever a parameter: QB sets it in the train state) and the
    # zero-initialised attention gate, which hyperball would pin at norm 0 forever.
    (r"(^|\.)router(_bias)?$", "adam"),
    (r"(^|\.)attention\.w_gate$", "adam"),
    # Every gain: RMSNorm gains, the latent norm, the learnable qk multiplier ablation.
    (r"\.gain$", "adam"),
    (r"(^|\.)qk_mult$", "adam"),
    (r"(^|\.)sconv_[a-z_]+\.weight$", "adam"),
    (r"^lm_head\.weight$", "adamh"),
    # Every other matrix: attention projections, GatedNorm, latent projections, routed and shared experts.
    (r"", "muonh"),
)
_COMPILED = tuple((re.compile(pattern), group) for pattern, group in GROUP_RULES)


def group_of(path: str) -> Group:
    """The optimizer group of the leaf at dotted `path` (docs/recipe.md §5's table, first match wins)."""
    for pattern, group in _COMPILED:
        if pattern.search(path):
            return group
    raise AssertionError("the last rule matches every path")


def param_group_labels(params) -> object:
    """Same structure as `params`, each array leaf replaced by "adam" | "adamh" | "muonh".

    `params` is the array part of the model (e.g. `eqx.filter(model, eqx.is_inexact_array)`), or any
    tree with the same key paths (gradients, `jax.eval_shape` results, a flat {path: array} dict).
    """
    return jax.tree.map(group_of, tree_paths(params))


def group_sizes(recipe: Recipe) -> dict[Group, int]:
    """Parameters per optimizer group, from the parameter table (what `marinctl plan` lists)."""
    sizes: dict[Group, int] = dict.fromkeys(GROUPS, 0)
    for spec in param_table(recipe).values():
        sizes[spec.group] += spec.size
    return sizes


def _leading(spec: ParamSpec, names: tuple[str, ...]) -> int:
    """How many leading axes of `spec` are in `names` (stack axes always lead in the table)."""
    n = 0
    while n < len(spec.axes) and spec.axes[n] in names:
        n += 1
    return n


def norm_axes(spec: ParamSpec) -> tuple[int, ...]:
    """Axes a hyperball norm reduces over: all but the leading per-layer / per-shared-expert axes.

    Expert stacks `[L, E, in, out]` therefore keep one norm per layer jointly over their experts (docs/recipe.md §5).
    """
    return tuple(range(_leading(spec, NORM_KEEP_AXES), len(spec.shape)))


def hyperball_norms(params, recipe: Recipe) -> dict[str, jax.Array]:
    """{path: fp32 norm per scope} of every AdamH/MuonH leaf (per layer, per shared expert), for logging.

    Same scopes and arithmetic as the optimizer's frozen norms (`hyperball.initial_norms`), so a
    monitor can compare the two directly.
    """
    table = param_table(recipe)
    out = {}
    for path, leaf in zip(jax.tree.leaves(tree_paths(params)), jax.tree.leaves(params), strict=True):
        spec = table[path]
        if spec.group in ("muonh", "adamh"):
            axes = norm_axes(spec)
            out[path] = jnp.squeeze(frobenius_norm(leaf, axes), axis=axes)
    return out


def matrix_batch_ndim(spec: ParamSpec) -> int:
    """Leading axes that index separate matrices for Newton-Schulz (per layer, per expert, per shared).

    Raises ValueError unless exactly two axes (in, out) remain: the orthogonalization is per matrix.
    """
    n = _leading(spec, MATRIX_BATCH_AXES)
    if len(spec.shape) - n != 2:
        raise ValueError(f"a MuonH leaf needs [*stack, in, out] axes, got {spec.axes}")
    return n
