"""Routing and expert parallelism: quantile balancing, meshes, transports (SPEC 3-4)."""
