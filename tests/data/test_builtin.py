"""The built-in corpus: real Python docs and stdlib code, two domains, deterministic held-out splits."""

import hashlib
import time

import pytest

from marinctl.data.builtin import STORES, code_split, docs_split, ensure_builtin_corpus
from marinctl.data.store import JaggedStore, read_manifest
from marinctl.data.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def built(tiny_recipe, tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return root, ensure_builtin_corpus(tiny_recipe, root=root)


def test_builds_exactly_the_stores_the_tiny_recipe_names(tiny_recipe, built):
    root, paths = built
    assert {str(p.relative_to(root)) for p in paths.values()} == {s.path for s in tiny_recipe.data.sources}
    for name in STORES:
        store = JaggedStore(paths[name])
        assert store.documents > 0 and store.manifest["complete"]


def test_domains_are_real_english_prose_and_python_code(built):
    _, paths = built
    tok = ByteTokenizer()
    from pydoc_data.topics import topics

    docs = JaggedStore(paths["docs_train"])
    first = tok.decode(docs.document(0))
    assert first in topics.values()  # verbatim from the installation's documentation
    code = JaggedStore(paths["code_train"])
    text = tok.decode(code.read_tokens(0, 200_000))
    assert text.count("def ") > 100 and text.count("import ") > 20
    prose = tok.decode(docs.read_tokens(0, 200_000))
    assert prose.count(" the ") > 500 and prose.count("def ") < prose.count(" the ") / 10


def test_held_out_documents_never_appear_in_training_stores(built):
    _, paths = built
    for domain in ("docs", "code"):
        train, val = JaggedStore(paths[f"{domain}_train"]), JaggedStore(paths[f"{domain}_val"])

        def digests(store):
            return {hashlib.sha256(store.document(i).tobytes()).digest() for i in range(store.documents)}

        shared = digests(train) & digests(val)
        assert not shared
        fraction = val.documents / (val.documents + train.documents)
        assert 0.05 < fraction < 0.2


def test_selection_and_split_are_deterministic():
    assert docs_split() == docs_split()
    train, val = code_split()
    assert (train, val) == code_split()
    assert sum(f.size for f in train + val) >= 3 << 20 and not {f.display for f in train} & {f.display for f in val}


def test_second_call_is_an_idempotent_cheap_no_op(tiny_recipe, built):
    root, paths = built
    before = {name: read_manifest(p)["run"] for name, p in paths.items()}
    started = time.perf_counter()
    assert ensure_builtin_corpus(tiny_recipe, root=root) == paths
    assert time.perf_counter() - started < 2.0
    assert {name: read_manifest(p)["run"] for name, p in paths.items()} == before  # nothing rewritten
