"""Run the trainer's eval step and train step back to back, many times, on 8 simulated CPU devices.

The pattern of `marinctl train` at its start (eval at step 0, then the first steps) is where XLA:CPU aborted
when devices reached different collectives. Run as a script by tests/faults/test_collectives.py (and by hand:
`python tests/faults/collective_soak.py RECIPE ITERATIONS [--set k=v ...]`); prints `ok N` when every
iteration finished. The XLA_FLAGS of the environment decide the CPU scheduler under test.
"""

import sys


def main(argv: list[str]) -> None:
    recipe_path, iterations, overrides = argv[0], int(argv[1]), [a for a in argv[2:] if a != "--set"]
    from marinctl.recipe import load_recipe
    from marinctl.runtime import apply_runtime

    recipe = load_recipe(recipe_path, overrides)
    apply_runtime(recipe.runtime)  # exactly what `marinctl train` does before JAX starts

    import jax

    from marinctl.data.builtin import ensure_builtin_corpus
    from marinctl.data.loader import Loader
    from marinctl.routing.mesh import batch_sharding, make_mesh
    from marinctl.train.evaluate import compile_eval_step, evaluate
    from marinctl.train.loop import configure_jax
    from marinctl.train.state import init_state, make_optimizer, state_shardings
    from marinctl.train.step import compile_train_step, device_batch

    configure_jax()
    ensure_builtin_corpus(recipe)
    loader = Loader(recipe)
    mesh = make_mesh(recipe.parallel, jax.devices())
    rows = batch_sharding(mesh)
    optimizer = make_optimizer(recipe)
    shardings = state_shardings(recipe, optimizer, mesh)
    with jax.set_mesh(mesh):
        state = jax.jit(lambda: init_state(recipe, optimizer), out_shardings=shardings)()
        train_step = compile_train_step(recipe, optimizer, shardings, rows)
        eval_step = compile_eval_step(recipe, shardings.model, rows)
        for i in range(iterations):
            evaluate(eval_step, state.model, state.router_bias, loader, recipe, rows)
            batch = device_batch(loader.batch(i), rows, recipe.train.batch_size)
            state, metrics = train_step(state, batch)
            state, metrics = train_step(state, device_batch(loader.batch(i + 1), rows, recipe.train.batch_size))
            jax.device_get(metrics["loss"])
            print(f"iteration {i} done", flush=True)
    print(f"ok {iterations}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
