"""`build_optimizer`: the three docs/recipe.md §5 groups as one optax transformation, plus state shardings.

    adam   scale_by_adam -> -adam_lr * schedule   (+ decoupled weight decay on gate and router)
    adamh  scale_by_adam -> hyperball(adamh_lr * schedule)                       lm_head
    muonh  Nesterov momentum -> Newton-Schulz -> hyperball(muonh_lr * schedule)  every other matrix

Every state leaf is an array: momenta and Adam moments shaped like their parameter, frozen hyperball
norms over the kept axes ([L], [L, n] or []), and int32 step counts. Leaf key paths end with the
parameter's dotted path, which is how `optimizer_state_shardings` gives the matching NamedSharding
tree (for jit out_shardings and orbax restore) and how flat checkpoints name them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from marinctl.hparams import hyperparams
from marinctl.optim.groups import group_of, matrix_batch_ndim, norm_axes, param_group_labels
from marinctl.optim.hyperball import hyperball
from marinctl.optim.muon import coefficient_schedule, scale_by_muon
from marinctl.optim.schedule import lr_schedule, weight_decay_schedule
from marinctl.params import param_table, path_str, spec_for, tree_paths
from marinctl.recipe import Recipe

# docs/recipe.md §5: the only leaves weight decay may touch (both live outside hyperball).
WEIGHT_DECAY_PATHS = frozenset({"blocks.attention.w_gate", "blocks.moe.router"})


def decoupled_weight_decay(rate: optax.Schedule, paths: frozenset[str]) -> optax.GradientTransformation:
    """Adds `-rate(count) * p` to the update of the leaves at `paths` (AdamW-style, after the LR)."""

    def init(params: optax.Params) -> optax.ScaleByScheduleState:
        del params
        return optax.ScaleByScheduleState(jnp.zeros([], jnp.int32))

    def update(updates: optax.Updates, state: optax.ScaleByScheduleState, params: optax.Params | None = None):
        if params is None:
            raise ValueError("weight decay needs the current parameters: call update(grads, state, params)")
        decay = rate(state.count)

        def one(path, u, p):
            return u - decay * p.astype(u.dtype) if path_str(path) in paths else u

        new = jax.tree_util.tree_map_with_path(one, updates, params)
        return new, optax.ScaleByScheduleState(optax.safe_increment(state.count))

    return optax.GradientTransformation(init, update)


def build_optimizer(recipe: Recipe, params) -> optax.GradientTransformation:
    """The hyperball optimizer for `params` (the model's array leaves, concrete or abstract).

    Hyperparameters come from `marinctl.hparams.hyperparams` (the heuristic, or pinned in `[optimizer]`).
    Raises ValueError when a leaf's path or shape disagrees with the parameter table.
    """
    hp, o = hyperparams(recipe), recipe.optimizer
    table = param_table(recipe)
    scopes: dict[str, tuple[int, ...]] = {}
    for path, leaf in zip(jax.tree.leaves(tree_paths(params)), jax.tree.leaves(params), strict=True):
        try:
            spec = spec_for(path, table)
        except KeyError as err:
            raise ValueError(err.args[0]) from None
        if tuple(leaf.shape) != spec.shape:
            raise ValueError(f"parameter {path} has shape {tuple(leaf.shape)}, the table says {spec.shape}")
        if group_of(path) != spec.group:
            raise ValueError(f"parameter {path}: recipe §5 rules say {group_of(path)}, the table says {spec.group}")
        if spec.group == "muonh":
            matrix_batch_ndim(spec)  # raises unless the leaf is [*stack, in, out]
        if spec.group in ("muonh", "adamh"):
            scopes[path] = norm_axes(spec)

    experts_dims = {p: s.axes.index("experts") for p, s in table.items() if s.group == "muonh" and "experts" in s.axes}
    adam_tail = []
    if o.weight_decay > 0:
        # Strength weight_decay * adam_lr (AdamW's lr * lambda), annealed linearly to 0 at the last step
        # independently of the LR warmup/decay: docs/recipe.md §5 gives only "annealed linearly to 0".
        adam_tail.append(
            decoupled_weight_decay(weight_decay_schedule(hp, o.weight_decay * hp.adam_lr), WEIGHT_DECAY_PATHS)
        )
    transforms = {
        "adam": optax.chain(
            optax.scale_by_adam(hp.beta1, hp.beta2, hp.epsilon),
            optax.scale_by_learning_rate(lr_schedule(hp, hp.adam_lr)),
            *adam_tail,
        ),
        "adamh": optax.chain(
            optax.scale_by_adam(hp.beta1, hp.beta2, hp.epsilon),
            hyperball(lr_schedule(hp, hp.adamh_lr), scopes),
        ),
        "muonh": optax.chain(
            scale_by_muon(o.muon_momentum, coefficient_schedule(o.ns_coefficients, o.ns_steps), experts_dims),
            hyperball(lr_schedule(hp, hp.muonh_lr), scopes),
        ),
    }
    # Labels as a function of the tree: a labels tree built from an equinox module would be a (callable)
    # module itself, which optax would mistake for a labelling function.
    optimizer = optax.multi_transform(transforms, param_group_labels)
    if o.grad_clip > 0:
        optimizer = optax.chain(optax.clip_by_global_norm(o.grad_clip), optimizer)
    return optimizer


def optimizer_state_shardings(optimizer: optax.GradientTransformation, params, param_shardings):
    """NamedShardings for `optimizer.init(params)`: param-shaped leaves shard like their parameter.

    A state leaf belongs to parameter `p` when its key path ends with p's dotted path and it has p's
    shape (momenta, Adam moments). Everything else (step counts, hyperball norms over the kept layer /
    shared-expert axes) is small and replicated. `params` may be abstract (`jax.ShapeDtypeStruct`s).
    """
    shardings = jax.tree.leaves(param_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    owners = {
        path: (tuple(leaf.shape), sharding)
        for path, leaf, sharding in zip(
            jax.tree.leaves(tree_paths(params)), jax.tree.leaves(params), shardings, strict=True
        )
    }
    replicated = NamedSharding(shardings[0].mesh, PartitionSpec())

    def pick(path, leaf) -> NamedSharding:
        key = path_str(path)
        matches = [p for p in owners if (key == p or key.endswith("." + p)) and owners[p][0] == tuple(leaf.shape)]
        return owners[max(matches, key=len)][1] if matches else replicated

    return jax.tree_util.tree_map_with_path(pick, jax.eval_shape(optimizer.init, params))
