"""Stages: one module per subcommand, registered under the `marinctl.stages` entry-point group."""
