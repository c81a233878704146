"""accel's GGUF header reader against gguf-py's GGUFReader, and its refusals of damaged files."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import needs_smollm2

from accel.converters.gguf_header import GGUFArray, GGUFHeader, GGUFHeaderError

Q = gguf.GGMLQuantizationType


def write_sample(path: Path, alignment: int | None = None) -> Path:
    """A GGUF file with every scalar type, string and number arrays, and float and block-quantized tensors."""
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1e-5)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo wörld")
    writer.add_string("t.empty", "")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc", "", "ü" * 9] * 50)
    writer.add_array("t.ints", list(range(37)))
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.none", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((7,)).astype(np.float16))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    for kind, shape in ((Q.Q8_0, (4, 64)), (Q.Q4_1, (3, 32)), (Q.Q8_0, (2, 3, 32))):
        x = rng.standard_normal(shape).astype(np.float32)
        writer.add_tensor(f"{kind.name}-{len(shape)}d", gguf.quants.quantize(x, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_same_as_gguf_reader(path: Path) -> None:
    """Every field, tensor and offset as gguf-py reads them."""
    reader = gguf.GGUFReader(str(path))
    header = GGUFHeader(path)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(header.fields) == list(fields)
    for key, field in fields.items():
        value = header.fields[key]
        assert header.types[key] == field.types[0].value, key
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            assert isinstance(value, GGUFArray) and value.count == len(field.data), key
            assert value.item_type == (field.types[1].value if len(field.types) > 1 else value.item_type)
            assert value.start == field.offset + sum(int(p.nbytes) for p in field.parts[:5]), key
            assert value.end == field.offset + sum(int(p.nbytes) for p in field.parts), key
        elif field.types[0] == gguf.GGUFValueType.STRING:
            assert value == bytes(field.parts[field.data[0]]).decode("utf-8"), key
        else:
            assert value == field.parts[field.data[0]][0].item() and type(value) is type(
                field.parts[field.data[0]][0].item()), key
    last = next(reversed(fields.values()))
    assert header.metadata_end == last.offset + sum(int(p.nbytes) for p in last.parts)
    assert header.alignment == reader.alignment and header.data_offset == reader.data_offset
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(header.tensors, reader.tensors):
        assert ours.shape == tuple(theirs.shape.tolist()) and ours.tensor_type == theirs.tensor_type
        assert (ours.n_elements, ours.n_bytes, ours.data_offset) == (theirs.n_elements, theirs.n_bytes,
                                                                     theirs.data_offset)
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert ours.data.tobytes() == theirs.data.tobytes() and not ours.data.flags.writeable


@pytest.mark.parametrize("alignment", [None, 64, 1])
def test_reads_what_gguf_py_reads(tmp_path, alignment):
    path = write_sample(tmp_path / "sample.gguf", alignment)
    assert_same_as_gguf_reader(path)
    header = GGUFHeader(path)
    assert header.fields["t.u64"] == 2**63 + 5 and header.fields["t.str"] == "héllo wörld"
    assert header.fields["tokenizer.ggml.tokens"].count == 200
    assert header.data_offset % (alignment or 32) == 0


def test_reads_the_dequantizable_views(tmp_path):
    """A quantized tensor's view is what gguf.quants.dequantize takes: the values come back as written."""
    path = tmp_path / "q.gguf"
    x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("w", gguf.quants.quantize(x, Q.Q8_0), raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = GGUFHeader(path).tensors
    expected = gguf.quants.dequantize(gguf.quants.quantize(x, Q.Q8_0), Q.Q8_0)
    assert np.array_equal(gguf.quants.dequantize(tensor.data, tensor.tensor_type), expected)


@needs_smollm2
def test_reads_smollm2_as_gguf_py_does():
    from accel.converters.aliases import resolve_alias

    assert_same_as_gguf_reader(resolve_alias("smollm2-135m"))


def test_every_truncation_of_the_directory_is_refused(tmp_path):
    """Cut anywhere in the header, metadata or tensor directory: a GGUFHeaderError, never another exception. Cut
    in the data: the error names the first tensor that lost bytes."""
    data = write_sample(tmp_path / "sample.gguf").read_bytes()
    header = GGUFHeader(tmp_path / "sample.gguf")
    cut = tmp_path / "cut.gguf"
    for n in range(header.data_offset):
        cut.write_bytes(data[:n])
        with pytest.raises(GGUFHeaderError):
            GGUFHeader(cut)
    last = header.tensors[-1]
    cut.write_bytes(data[:last.data_offset + 1])
    with pytest.raises(GGUFHeaderError, match=f"tensor '{last.name}' has 1 of its {last.n_bytes} bytes"):
        GGUFHeader(cut)


def test_damaged_bytes_are_refused_or_read_never_crash(tmp_path):
    """Seeded random byte changes in the header: each file is read or refused with GGUFHeaderError."""
    path = write_sample(tmp_path / "sample.gguf")
    data = path.read_bytes()
    end = GGUFHeader(path).data_offset
    rng = np.random.default_rng(0)
    damaged = tmp_path / "damaged.gguf"
    refused = 0
    for _ in range(400):
        changed = bytearray(data)
        for at in rng.integers(0, end, rng.integers(1, 4)):
            changed[at] = int(rng.integers(0, 256))
        damaged.write_bytes(bytes(changed))
        try:
            GGUFHeader(damaged)
        except GGUFHeaderError:
            refused += 1
    assert refused > 50  # the test changes the bytes that matter often enough to be a test


def _patched(data: bytes, old: bytes, new: bytes) -> bytes:
    assert data.count(old) == 1
    return data.replace(old, new)


@pytest.mark.parametrize("change, message", [
    (lambda d: b"GGUX" + d[4:], "no GGUF magic"),
    (lambda d: d[:4] + struct.pack("<I", 1) + d[8:], "GGUF version 1"),
    (lambda d: d[:4] + struct.pack(">I", 3) + d[8:], "big-endian"),
    (lambda d: _patched(d, b"t.i8", b"t.u8"), "metadata key 't.u8' appears twice"),
    (lambda d: _patched(d, b"t.u16" + struct.pack("<I", 2), b"t.u16" + struct.pack("<I", 13)),
     "metadata 't.u16' has an unknown value type 13"),
    (lambda d: d[:16] + struct.pack("<Q", 2**40) + d[24:], "1099511627776 metadata entries"),
])
def test_refusals_name_the_damage(tmp_path, change, message):
    path = write_sample(tmp_path / "sample.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(change(path.read_bytes()))
    with pytest.raises(GGUFHeaderError, match=message):
        GGUFHeader(bad)


def test_alignment_must_be_a_power_of_two(tmp_path):
    path = write_sample(tmp_path / "sample.gguf", alignment=64)
    key = b"general.alignment" + struct.pack("<I", 4)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(_patched(path.read_bytes(), key + struct.pack("<I", 64), key + struct.pack("<I", 48)))
    with pytest.raises(GGUFHeaderError, match="general.alignment 48 is not a power of two"):
        GGUFHeader(bad)


def test_a_string_array_cut_between_items_is_refused(tmp_path):
    """The last metadata entry a string array whose last items are cut off, fewer than 8 bytes left: nothing read
    after it fails, so the array's own walk must (it stopped early and read as whole)."""
    key = b"t.strings"
    body = struct.pack("<4sIQQ", b"GGUF", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 8, 3)
    body += struct.pack("<Q", 16) + b"x" * 16 + struct.pack("<Q", 1) + b"y"  # items 1 and 2 whole
    path = tmp_path / "cut.gguf"
    path.write_bytes(body + b"\0" * 7)  # item 3's length cut to 7 of its 8 bytes
    with pytest.raises(GGUFHeaderError, match="metadata 't.strings'.*runs past the end"):
        GGUFHeader(path)
    path.write_bytes(body + struct.pack("<Q", 0))  # item 3 whole (empty): read
    assert GGUFHeader(path).fields["t.strings"].count == 3


def test_nested_arrays_are_walked_and_bounded(tmp_path):
    """gguf-py writes no arrays of arrays, but GGUF allows them: one is walked over; nesting past MAX_NESTING is
    refused, not recursed into."""
    def array_of(depth: int) -> bytes:
        if depth == 0:
            return struct.pack("<IQ", 4, 2) + struct.pack("<2I", 7, 8)
        return struct.pack("<IQ", 9, 1) + array_of(depth - 1)

    def file_with(depth: int) -> Path:
        key = b"t.nested"
        body = struct.pack("<4sIQQ", b"GGUF", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 9)
        path = tmp_path / f"nested{depth}.gguf"
        path.write_bytes(body + array_of(depth))
        return path

    value = GGUFHeader(file_with(3)).fields["t.nested"]
    assert value.item_type == 9 and value.count == 1 and value.end == file_with(3).stat().st_size
    with pytest.raises(GGUFHeaderError, match="nests arrays deeper than 8"):
        GGUFHeader(file_with(20))
