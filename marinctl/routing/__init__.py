"""Routing and expert parallelism: quantile balancing, meshes, transports (docs/recipe.md §3-4)."""
