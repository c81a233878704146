"""The trained hybrid fixtures: aliases, architecture, byte-level tokenizer, and that they really learned text."""

from __future__ import annotations

import json

import numpy as np
import pytest

from accel.converters import open_model
from accel.converters.aliases import FIXTURES_DIR, alias_table
from accel.eval.load import load_causal_lm
from accel.eval.perplexity import window_nll
from accel.fixtures.corpus import docstring_text, heldout_text, pydoc_train_text, train_text
from accel.runtime.state_shapes import state_shape

EXPECTED = {"tiny-gdn": ("qwen3_5_text", "gdn"), "tiny-kda": ("kimi_linear", "kda")}


def test_aliases_resolve_to_the_committed_directories():
    rows = {row.name: row for row in alias_table()}
    for name in EXPECTED:
        assert rows[name].problem is None and rows[name].path == FIXTURES_DIR / name


def test_corpus_split_is_disjoint():
    held, train = heldout_text(), pydoc_train_text()
    assert 25_000 < len(held) < 40_000 and len(train) > 10 * len(held)
    assert not any(held[i:i + 200] in train for i in range(0, len(held) - 200, 1000))


def test_docstring_text_is_large_and_not_in_the_training_text():
    docs, train = docstring_text(), train_text()
    assert len(docs) > 1_000_000  # ~3,300 windows of 512 bytes, against the held-out pydoc text's ~57
    paragraphs = [p.strip() for p in docs.split("\n\n")]
    assert len(paragraphs) == len(set(paragraphs))
    assert not set(paragraphs) & {p.strip() for p in train.split("\n\n")}
    assert not any(docs[i:i + 200] in train for i in range(0, len(docs) - 200, 20_000))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_is_a_small_hybrid_with_a_byte_tokenizer(name):
    model_type, arch = EXPECTED[name]
    with open_model(name) as source:
        assert source.config["model_type"] == model_type
        assert {source.tensor_dtype(t) for t in source.tensor_names()} == {"float16"}
        params = sum(int(np.prod(source.tensor_shape(t))) for t in source.tensor_names())
        assert 2_000_000 < params < 5_000_000  # a few million
        tok = source.load_tokenizer()
        text = "naïve — x ≥ 1\n"
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text
        shape = state_shape(source.config)
    types = source.config["layer_types"]
    assert shape.arch == arch and len(shape.layers) >= 2 and "full_attention" in types
    info = json.loads((FIXTURES_DIR / name / "training.json").read_text())
    assert info["heldout_ppl_float16"] < info["unigram_ppl"] / 4


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_beats_a_unigram_model_on_held_out_text(name):
    loaded = load_causal_lm(name)
    ids = np.asarray(loaded.tokenizer(heldout_text()[:6000], add_special_tokens=False)["input_ids"])
    windows = ids[: 4 * 256].reshape(4, 256)
    ppl = window_nll(loaded.model, windows).ppl
    train_ids = np.frombuffer(pydoc_train_text().encode("utf-8"), dtype=np.uint8)
    counts = np.bincount(train_ids, minlength=257) + 1.0
    unigram = float(np.exp(-np.log(counts / counts.sum())[windows[:, 1:]].mean()))
    assert ppl < unigram / 4, (ppl, unigram)
