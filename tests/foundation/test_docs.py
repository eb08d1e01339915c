"""The README's recipe reference lists every schema key with its default (regenerated, never stale)."""

from pathlib import Path

from marinctl.docs import render
from marinctl.recipe import schema_keys

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_recipe_reference_matches_the_schema():
    text = README.read_text()
    assert render(text) == text, "README recipe reference is stale: run `python -m marinctl.docs README.md`"
    for key, *_ in schema_keys():
        assert f"`{key}`" in text
