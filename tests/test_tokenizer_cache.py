"""The GGUF tokenizer cache: a converted tokenizer is saved once and loaded after, with the same behaviour and the
same support-file bytes as a fresh conversion; a damaged entry is rebuilt; the key follows the metadata."""

from __future__ import annotations

from pathlib import Path

from conftest import needs_smollm2

from accel.converters import GGUFSource, open_model
from accel.converters.tokenizer_cache import cache_key, cached_tokenizer

TEXT = "def f(x):\n    return x + 1  # the for statement is used to iterate"


def _builds(monkeypatch) -> list[int]:
    """Count GGUFSource's conversions."""
    calls: list[int] = []
    original = GGUFSource._build_tokenizer

    def counted(self):
        calls.append(1)
        return original(self)

    monkeypatch.setattr(GGUFSource, "_build_tokenizer", counted)
    return calls


@needs_smollm2
def test_a_gguf_tokenizer_is_converted_once_and_saved_the_same(tmp_path, monkeypatch):
    """The first load converts and saves the entry; the second loads it: the same ids, and the support files
    quantize writes are the bytes of the converted tokenizer's."""
    builds = _builds(monkeypatch)
    monkeypatch.setenv("ACCEL_TOKENIZER_CACHE", str(tmp_path / "cache"))
    tokenizers = {}
    for run in ("converted", "cached"):
        with open_model("smollm2-135m") as src:
            # the progress label of a conversion: only before the first one
            assert src.tokenizer_work() == ("converting the GGUF tokenizer (once: cached)" if run == "converted"
                                            else None)
            tokenizers[run] = src.load_tokenizer()
            assert src.tokenizer_work() is None
            src.save_support_files(tmp_path / run)
        assert len(builds) == 1
    monkeypatch.setenv("ACCEL_TOKENIZER_CACHE", "off")
    with open_model("smollm2-135m") as src:
        assert src.tokenizer_work() == "converting the GGUF tokenizer"
    assert tokenizers["cached"](TEXT).input_ids == tokenizers["converted"](TEXT).input_ids
    assert len(tokenizers["cached"]) == len(tokenizers["converted"]) == 49152
    names = sorted(p.name for p in (tmp_path / "converted").iterdir())
    assert "tokenizer.json" in names and names == sorted(p.name for p in (tmp_path / "cached").iterdir())
    for name in names:
        assert (tmp_path / "cached" / name).read_bytes() == (tmp_path / "converted" / name).read_bytes(), name


class FakeTokenizer:
    def __init__(self, size: int, writable: bool = True):
        self.size, self.writable = size, writable

    def __len__(self):
        return self.size

    def save_pretrained(self, path):
        if not self.writable:
            raise OSError("read-only")
        (Path(path) / "tokenizer.json").write_text("{")  # an entry transformers cannot load


def test_cache_entries_follow_their_inputs(tmp_path, monkeypatch):
    assert cache_key(b"metadata") == cache_key(b"metadata") != cache_key(b"metadatA")
    monkeypatch.setenv("ACCEL_TOKENIZER_CACHE", str(tmp_path))
    assert len(cached_tokenizer("k", 5, lambda: FakeTokenizer(5, writable=False))) == 5
    assert not any(tmp_path.iterdir())  # a cache that cannot be written is skipped, nothing half-written left
    builds = []

    def build():
        builds.append(1)
        return FakeTokenizer(5)

    cached_tokenizer("k", 5, build)
    cached_tokenizer("k", 5, build)  # the entry does not load: built again, and replaced
    assert len(builds) == 2 and [p.name for p in tmp_path.iterdir()] == ["k"]
    monkeypatch.setenv("ACCEL_TOKENIZER_CACHE", "off")
    cached_tokenizer("j", 5, build)
    assert len(builds) == 3 and [p.name for p in tmp_path.iterdir()] == ["k"]


def test_a_directory_tokenizer_is_no_work(tiny_llama):
    with open_model(tiny_llama) as src:
        assert src.tokenizer_work() is None  # its files are read, nothing converted: no stage of its own
