"""The documents the repository owns: the README's generated recipe reference, and the recipe citations.

Code, tests, recipes and the README cite the recipe as `docs/recipe.md §N` (or `recipe §N` where short,
N or N.M); every cited section must exist in docs/recipe.md, and the design notes the project started
from (cited as "SPEC N") are not in the repository, so no such citation may remain.
"""

import re
from pathlib import Path

from marinctl.docs import render
from marinctl.recipe import schema_keys

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
RECIPE_DOC = REPO / "docs" / "recipe.md"
OPERATIONS_DOC = REPO / "docs" / "operations.md"

CITATION = re.compile(
    r"(?:docs/recipe\.md|\brecipe)\s+§\s*(\d+(?:\.\d+)?)((?:\s*(?:,|and|or|–|-)\s*§?\s*\d+(?:\.\d+)?)*)"
)
# Built from pieces so this file does not match itself.
STALE = re.compile("SP" + r"EC\s*§?\s*\d")
SCANNED_DIRS = ("marinctl", "stages", "tests", "recipes", "bench", "completions", "docs", ".ci")
SCANNED_SUFFIXES = {".py", ".md", ".toml", ".sh", ".fish", ".bash", ".zsh", ".txt", ".yaml", ".yml", ""}


def test_readme_recipe_reference_matches_the_schema():
    text = README.read_text()
    assert render(text) == text, "README recipe reference is stale: run `python -m marinctl.docs README.md`"
    for key, *_ in schema_keys():
        assert f"`{key}`" in text


def recipe_sections() -> set[str]:
    """Section numbers docs/recipe.md defines: `## N. Title` headings and `**N.M Title.**` paragraphs."""
    text = RECIPE_DOC.read_text()
    top = set(re.findall(r"^## (\d+)\. ", text, flags=re.M))
    sub = set(re.findall(r"^\*\*(\d+\.\d+) ", text, flags=re.M))
    return top | sub


def scanned_files() -> list[Path]:
    files = [README]
    for name in SCANNED_DIRS:
        root = REPO / name
        if root.is_dir():
            files += [
                p
                for p in sorted(root.rglob("*"))
                if p.is_file() and p.suffix in SCANNED_SUFFIXES and "__pycache__" not in p.parts
            ]
    return files


def citations(text: str) -> list[str]:
    """Every section number cited in `text` ('docs/recipe.md §2.6', 'recipe §4, §8', ...)."""
    out = []
    for match in CITATION.finditer(text):
        out.append(match.group(1))
        out += re.findall(r"\d+(?:\.\d+)?", match.group(2) or "")
    return out


def test_recipe_document_has_the_ten_sections_in_order():
    text = RECIPE_DOC.read_text()
    assert re.findall(r"^## (\d+)\. ", text, flags=re.M) == [str(n) for n in range(1, 11)]
    for n in range(1, 11):  # subsections are numbered inside their section, in order
        subs = re.findall(rf"^\*\*{n}\.(\d+) ", text, flags=re.M)
        assert [int(s) for s in subs] == list(range(1, len(subs) + 1)), (n, subs)


def test_every_recipe_citation_names_a_section_the_document_has():
    sections = recipe_sections()
    cited: dict[str, list[str]] = {}
    for path in scanned_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number in citations(text):
            cited.setdefault(number, []).append(str(path.relative_to(REPO)))
    missing = {n: where[:3] for n, where in cited.items() if n not in sections}
    assert not missing, f"citations of sections docs/recipe.md does not have: {missing}"
    assert len(cited) >= 10  # the code does cite the document (the scan is not looking in the wrong place)


def test_no_citation_of_the_design_notes_remains():
    stale = []
    for path in scanned_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        stale += [f"{path.relative_to(REPO)}:{text[: m.start()].count(chr(10)) + 1}" for m in STALE.finditer(text)]
    assert not stale, f"cite docs/recipe.md §N instead: {stale[:10]}"


def test_the_citation_pattern_and_the_section_index():
    assert citations("see docs/recipe.md §2.6 and recipe §4, §8; not recipe.toml") == ["2.6", "4", "8"]
    assert citations("(docs/recipe.md §3.5: the bias)") == ["3.5"]
    sections = recipe_sections()
    assert {"1", "2", "2.6", "3.5", "10"} <= sections and "11" not in sections and "2.99" not in sections


def test_operations_document_covers_the_cluster_workflow():
    text = OPERATIONS_DOC.read_text()
    for needed in ("#SBATCH", "scontrol requeue", "marinctl switch-ep", "marinctl extend-context",
                   "metrics.jsonl", "marinctl plot", "--tasks", "--format hf", "marinctl import"):  # fmt: skip
        assert needed in text, needed
