"""Hyperball optimizer: MuonH / AdamH / Adam groups (SPEC 5)."""
