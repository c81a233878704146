"""The container: valid safetensors, deterministic bytes, sharding, and clean refusals of corrupt files."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest
from conftest import mutate_json
from safetensors import safe_open

from accel.errors import FormatError
from accel.formats import AccelFile, Artifact, encode_tensor, write_file, write_weights
from accel.formats.artifact import WeightsWriter
from accel.formats.container import FORMAT_VERSION
from accel.formats.tensor import decode_parts


def _encoded(rng):
    x = rng.standard_normal((6, 50)).astype(np.float32)
    return [encode_tensor("a.weight", x, "affine", levels=16, group=16),
            encode_tensor("b.weight", x[:, :7], "affine", levels=5, group=8, symmetric=True),
            encode_tensor("norm.weight", x[0], "raw", role="kept", dtype="bfloat16")]


def _write(path, rng):
    items = _encoded(rng)
    arrays = {k: v for _, a in items for k, v in a.items()}
    write_file(path, [e for e, _ in items], arrays)
    return path


def _split(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _rewrite(path, header, data):
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


def _set_doc(header, doc):
    """Put a (changed) document into a header as a writer would, its SHA-256 with it: the tests of the document's
    validation go past the hash check, which alone would refuse every change."""
    text = json.dumps(doc)
    header["__metadata__"]["accel"] = text
    header["__metadata__"]["accel_sha256"] = hashlib.sha256(text.encode()).hexdigest()


def _rewrite_doc(path, mutate):
    header, data = _split(path)
    doc = json.loads(header["__metadata__"]["accel"])
    mutate(doc)
    _set_doc(header, doc)
    _rewrite(path, header, data)


def test_file_is_valid_safetensors_and_deterministic(tmp_path, rng):
    a = _write(tmp_path / "a.safetensors", np.random.default_rng(5))
    b = _write(tmp_path / "b.safetensors", np.random.default_rng(5))
    assert a.read_bytes() == b.read_bytes()
    with safe_open(a, "np") as f:
        names = set(f.keys())
        assert {"a.weight:codes", "norm.weight"} <= names
        doc = json.loads(f.metadata()["accel"])
    assert doc["format"] == "accel" and doc["version"] == FORMAT_VERSION


def test_sharded_output_reads_back_like_one_file(tmp_path, rng):
    items = _encoded(rng)
    (tmp_path / "one").mkdir()
    (tmp_path / "many").mkdir()
    write_weights(tmp_path / "one", items)
    paths = write_weights(tmp_path / "many", items, max_shard_bytes=100)
    assert len(paths) == 3 and (tmp_path / "many" / "model.safetensors.index.json").exists()
    one, many = Artifact(tmp_path / "one"), Artifact(tmp_path / "many")
    assert one.names == many.names
    for name in one.names:
        assert np.array_equal(one.decode(name), many.decode(name))
        assert one.report(name) == many.report(name)


@pytest.mark.parametrize("max_shard_bytes", [100, 1 << 30])
def test_streamed_weights_are_the_bytes_write_weights_writes(tmp_path, rng, max_shard_bytes):
    """WeightsWriter takes the tensors one at a time, in any order, and spills them; its files are write_weights'
    bit for bit (one file, or three shards and the index), and its scratch file is gone."""
    items = _encoded(rng)
    (tmp_path / "whole").mkdir()
    (tmp_path / "streamed").mkdir()
    write_weights(tmp_path / "whole", items, max_shard_bytes, extra={"note": 1})
    with WeightsWriter(tmp_path / "streamed", max_shard_bytes) as writer:
        for item in reversed(items):
            writer.add(item)
        writer.finish(extra={"note": 1})
    whole, streamed = sorted((tmp_path / "whole").iterdir()), sorted((tmp_path / "streamed").iterdir())
    assert [p.name for p in whole] == [p.name for p in streamed]
    assert len(whole) == (4 if max_shard_bytes == 100 else 1)
    for a, b in zip(whole, streamed, strict=True):
        assert a.read_bytes() == b.read_bytes()


def test_streamed_weights_leave_nothing_on_an_error(tmp_path, rng):
    items = _encoded(rng)
    with pytest.raises(ValueError, match="added twice"), WeightsWriter(tmp_path) as writer:
        writer.add(items[0])
        writer.add(items[0])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("weight_map", [{"a": ["model.safetensors"]}, {"a": "model-00001-of-00003.safetensors", "b": 5},
                                        {"a": "../model.safetensors"}])
def test_shard_index_naming_no_file_is_refused(tmp_path, rng, weight_map):
    """A list or a number among the index's shard names was a TypeError (sorting or hashing them)."""
    write_weights(tmp_path, _encoded(rng), max_shard_bytes=100)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FormatError, match="not a shard file name"):
        Artifact(tmp_path)


def test_a_palette_group_wider_than_the_row_decodes_as_one_group(tmp_path, rng):
    """The lut codec's group was not clamped to the row as affine's is: a file with group 2^30 (its palette shape the
    same: one group a row) decoded through a (rows, 2^30) array, 24 GiB from a 732-byte file."""
    x = rng.standard_normal((3, 5)).astype(np.float32)
    entry, arrays = encode_tensor("w", x, "lut", levels=4, group=8)
    path = tmp_path / "t.safetensors"
    write_file(path, [entry], arrays)
    _rewrite_doc(path, lambda d: d["tensors"]["w"]["params"].update(group=2**30))
    f = AccelFile(path)
    assert np.array_equal(f.decode("w"), decode_parts(entry, {p: arrays[n] for p, n in entry.parts.items()}))


def test_truncated_file_is_refused(tmp_path, rng):
    path = _write(tmp_path / "t.safetensors", rng)
    raw = path.read_bytes()
    for cut in (4, 100, len(raw) - 1):
        path.write_bytes(raw[:cut])
        with pytest.raises(FormatError, match="truncated|past|after the last"):
            AccelFile(path)


def test_header_offset_past_end_is_refused(tmp_path, rng):
    path = _write(tmp_path / "t.safetensors", rng)
    header, data = _split(path)
    header["a.weight:codes"]["data_offsets"][1] += 10_000
    _rewrite(path, header, data)
    with pytest.raises(FormatError, match="a.weight:codes.*past the end"):
        AccelFile(path)


def test_a_document_changed_after_writing_is_refused_and_one_without_its_hash_is_read(tmp_path, rng):
    """A digit of a parameter (a Leech seed, say) changed in the header is valid JSON and a valid value: only the
    document's own SHA-256 sees it. Files written before the hash was recorded have none and read as before."""
    path = _write(tmp_path / "t.safetensors", rng)
    header, data = _split(path)
    text = header["__metadata__"]["accel"]
    assert header["__metadata__"]["accel_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    header["__metadata__"]["accel"] = text.replace('"version":2', '"version":1')
    _rewrite(path, header, data)
    with pytest.raises(FormatError, match="SHA-256 differs from accel_sha256 .it was changed after it was written"):
        AccelFile(path)
    del header["__metadata__"]["accel_sha256"]
    header["__metadata__"]["accel"] = text
    _rewrite(path, header, data)
    assert AccelFile(path).doc["version"] == 2


def test_flipped_byte_in_any_stored_tensor_is_named(tmp_path, rng):
    path = _write(tmp_path / "t.safetensors", rng)
    f = AccelFile(path)
    spans = {name: (start, end) for name, (_, _, start, end) in f.stored.items()}
    f.close()
    clean = path.read_bytes()
    for stored, (start, end) in spans.items():
        corrupt = bytearray(clean)
        corrupt[(start + end) // 2] ^= 0x01
        path.write_bytes(bytes(corrupt))
        f = AccelFile(path)
        logical = next(n for n, e in f.entries.items() if stored in e.parts.values())
        assert not f.checksum_ok(stored)
        with pytest.raises(FormatError, match=f"'{logical}'.*checksum"):
            f.decode(logical)


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d["tensors"]["a.weight"].update(codec="wavelet"), "unknown codec 'wavelet'"),
    (lambda d: d.update(version=FORMAT_VERSION + 1), "newer than this accel reads"),
    (lambda d: d["tensors"]["a.weight"].update(layout="zigzag"), "unknown layout 'zigzag'"),
    (lambda d: d["tensors"]["a.weight"].update(shape=[6, 51]), "shape mismatch"),
    (lambda d: d["tensors"]["a.weight"]["params"].update(levels=1000), "levels=1000"),
    (lambda d: d["tensors"]["a.weight"]["parts"].update(codes="gone:codes"), "'gone:codes' is missing"),
    (lambda d: d["checksums"].pop("b.weight:codes"), "no checksum"),
    (lambda d: d["tensors"].pop("b.weight"), "belongs to no logical tensor"),
])
def test_bad_document_is_refused_with_a_named_reason(tmp_path, rng, mutate, message):
    path = _write(tmp_path / "t.safetensors", rng)
    _rewrite_doc(path, mutate)
    with pytest.raises(FormatError, match=message):
        AccelFile(path)


@pytest.mark.parametrize("mutate", [
    lambda d: d["tensors"]["a.weight"].update(codec=["affine"]),
    lambda d: d["tensors"]["a.weight"].update(layout={"packed": 1}),
    lambda d: d["tensors"]["b.weight"]["parts"].update(codes={"x": 1}),
    lambda d: d["tensors"]["norm.weight"]["params"].update(dtype=["bfloat16"]),
])
def test_mistyped_document_fields_are_refused(tmp_path, rng, mutate):
    """A list or object where a name belongs was a TypeError (a traceback) instead of a FormatError."""
    path = _write(tmp_path / "t.safetensors", rng)
    _rewrite_doc(path, mutate)
    with pytest.raises(FormatError):
        AccelFile(path)


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.update(version=True), "format version True is not valid"),
    (lambda d: d["tensors"]["a.weight"].update(shape=[2**32] * 3), "2\\^40 elements or more"),
    (lambda d: d["tensors"]["a.weight"].update(codec=5), "t.safetensors: tensor 'a.weight'"),
    (lambda d: d["tensors"].update({"c.weight": d["tensors"]["a.weight"]}), "belongs to another part as well"),
])
def test_document_holes_found_in_review_are_refused(tmp_path, rng, mutate, message):
    """A boolean version (bool is an int in Python), a shape whose element count wraps int64 to 0, an entry error
    without the file's name, and two entries sharing stored tensors (design: each belongs to exactly one) were read."""
    path = _write(tmp_path / "t.safetensors", rng)
    _rewrite_doc(path, mutate)
    with pytest.raises(FormatError, match=message):
        AccelFile(path)


@pytest.mark.parametrize("where", ["header", "document"])
@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"x": "\\ud800"}'])
def test_json_that_parses_badly_is_a_format_error(tmp_path, rng, where, text):
    """Nesting deeper than the parser's recursion (RecursionError) and an escaped lone surrogate (which no UTF-8
    writer can print back) ended in tracebacks."""
    path = _write(tmp_path / "t.safetensors", rng)
    header, data = _split(path)
    if where == "header":
        head = text.encode()
        path.write_bytes(struct.pack("<Q", len(head)) + head + data)
    else:
        header["__metadata__"]["accel"] = text
        header["__metadata__"]["accel_sha256"] = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
        _rewrite(path, header, data)
    with pytest.raises(FormatError, match="not valid JSON|not a safetensors file"):  # "[": no JSON object
        AccelFile(path)


def test_random_document_mutations_fail_only_as_format_errors(tmp_path, rng):
    """Seeded fuzzing of the accel document: every field replaced by a value of another type or removed, and every
    file then read and decoded in full: it opens and decodes, or it is refused with a FormatError, never anything
    else. (20,000 such trials, and 6,000 of random byte flips, truncations and insertions in the header, found
    nothing else after the type checks above.)"""
    import random

    path = _write(tmp_path / "t.safetensors", rng)
    header, data = _split(path)
    doc = json.loads(header["__metadata__"]["accel"])

    values = [None, 0, -1, 2**40, 1.5, "x", "", [], [1], [-1, 3], {}, {"a": 1}, True, [6, 50], "float16", "planes"]
    pick = random.Random(3)
    for _ in range(400):
        mutated = json.loads(json.dumps(doc))
        mutate_json(mutated, pick, values, 0.15)
        _set_doc(header, mutated)
        _rewrite(path, header, data)
        try:
            f = AccelFile(path)
            for name in list(f.entries):
                f.decode(name)
            f.close()
        except FormatError:
            pass


def test_missing_stored_tensor_is_refused(tmp_path, rng):
    path = _write(tmp_path / "t.safetensors", rng)
    header, data = _split(path)
    start, end = header["b.weight:scale"]["data_offsets"]
    del header["b.weight:scale"]
    for info in header.values():
        if "data_offsets" in info and info["data_offsets"][0] >= end:
            info["data_offsets"] = [o - (end - start) for o in info["data_offsets"]]
    _rewrite(path, header, data[:start] + data[end:])
    with pytest.raises(FormatError, match="'b.weight:scale' is missing"):
        AccelFile(path)


def test_garbage_and_non_accel_files_are_refused(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\xff" * 64)
    with pytest.raises(FormatError):
        AccelFile(junk)
    plain = tmp_path / "plain.safetensors"
    from safetensors.numpy import save_file

    save_file({"x": np.zeros(3, np.float32)}, plain)
    with pytest.raises(FormatError, match="not an accel file"):
        AccelFile(plain)


def test_failed_write_leaves_nothing_behind(tmp_path, rng):
    entry, arrays = encode_tensor("a", rng.standard_normal((4, 8)).astype(np.float32), "affine", levels=4)
    arrays["a:codes"] = arrays["a:codes"][:-1]  # wrong size: the writer refuses before touching the disk
    with pytest.raises(ValueError):
        write_file(tmp_path / "x.safetensors", [entry], arrays)
    assert list(tmp_path.iterdir()) == []
