"""The README's recipe reference, generated from the schema so it cannot drift.

`python -m marinctl.docs README.md` rewrites the block between the recipe-keys markers;
`tests/foundation/test_docs.py` fails when the committed README differs from the schema.
"""

from __future__ import annotations

import sys
from pathlib import Path

from marinctl.recipe import schema_keys

BEGIN, END = "<!-- recipe-keys:begin -->", "<!-- recipe-keys:end -->"


def _show(value: object) -> str:
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "[" + ", ".join(_show(v) for v in value) + "]" if value else "[]"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, dict):
        return "{}" if not value else str(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def recipe_reference() -> str:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, type_name, default, doc in schema_keys():
        lines.append(f"| `{key}` | {type_name} | `{_show(default)}` | {doc.replace('|', '/')} |")
    return "\n".join(lines)


def render(readme: str) -> str:
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{recipe_reference()}\n{END}{tail}"


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "README.md")
    path.write_text(render(path.read_text()))
