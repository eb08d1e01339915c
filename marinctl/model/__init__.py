"""The hero model (SPEC 2) as equinox modules."""
