"""A float32 model larger than the memory left is refused in one line before any tensor is decoded."""

from __future__ import annotations

import pytest
from test_cli import assert_one_line_error, run

import accel.memory
from accel.memory import available_bytes, cgroup_available, float32_bytes, machine_available

MEMINFO = """MemTotal:       24575244 kB
MemFree:        22300112 kB
MemAvailable:   23012344 kB
Buffers:          102400 kB
SwapTotal:       2097148 kB
SwapFree:        1048576 kB
HugePages_Total:       0
"""


def test_a_machine_has_memavailable_plus_free_swap():
    assert machine_available(MEMINFO) == (23012344 + 1048576) * 1024
    assert machine_available(MEMINFO.replace("SwapFree:        1048576 kB\n", "")) == 23012344 * 1024
    assert machine_available("MemTotal: 1 kB\n") is None  # kernels before 3.14 have no MemAvailable: no check
    assert machine_available(None) is None


def test_a_memory_cgroup_has_its_limit_less_its_use_with_page_cache_free(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("8589934592\n")
    (v2 / "memory.current").write_text("6442450944\n")
    (v2 / "memory.stat").write_text("anon 4294967296\nfile 2147483648\nfile_mapped 0\n")
    assert cgroup_available(v2) == 2 * 2**30 + 2 * 2**30
    (v2 / "memory.max").write_text("max\n")  # no limit
    assert cgroup_available(v2) is None
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("4294967296\n")
    (v1 / "memory.usage_in_bytes").write_text("5368709120\n")  # over the limit: 0 left, then its cache
    (v1 / "memory.stat").write_text("cache 1\nrss 2\ntotal_cache 1073741824\n")
    assert cgroup_available(tmp_path / "v1") == 2**30
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert cgroup_available(tmp_path / "v1") is None
    assert cgroup_available(tmp_path / "none") is None


def test_the_smaller_of_machine_and_cgroup_counts(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO)
    monkeypatch.setattr(accel.memory, "MEMINFO", meminfo)
    monkeypatch.setattr(accel.memory, "CGROUP", tmp_path / "no-cgroup")
    assert available_bytes() == ((23012344 + 1048576) * 1024, "MemAvailable + SwapFree")
    (tmp_path / "cg").mkdir()
    (tmp_path / "cg" / "memory.max").write_text("1073741824")
    (tmp_path / "cg" / "memory.current").write_text("0")
    monkeypatch.setattr(accel.memory, "CGROUP", tmp_path / "cg")
    assert available_bytes() == (2**30, "the memory cgroup's limit less its use")
    monkeypatch.setattr(accel.memory, "MEMINFO", tmp_path / "no-meminfo")  # macOS: neither, no check
    monkeypatch.setattr(accel.memory, "CGROUP", tmp_path / "no-cgroup")
    assert available_bytes() is None


def test_this_machine_reports_its_memory():
    if not accel.memory.MEMINFO.exists():
        pytest.skip("no /proc/meminfo")
    assert available_bytes()[0] > 0


def test_float32_bytes():
    assert float32_bytes([(3, 4), (5,), ()]) == 4 * (12 + 5 + 1)
    assert float32_bytes([(128256, 4096)]) == 128256 * 4096 * 4  # past 2**31


@pytest.fixture
def little_memory(monkeypatch):
    monkeypatch.setattr(accel.memory, "available_bytes", lambda: (10_000, "MemAvailable + SwapFree"))


def test_eval_of_a_model_that_cannot_fit_is_refused_before_loading(capsys, tiny_llama, text_file, little_memory):
    from accel.converters import open_model

    with open_model(tiny_llama) as source:
        need = float32_bytes(source.tensor_shapes().values())
    code, _, err = run(capsys, "eval", tiny_llama, "--data", text_file, "--windows", "1", "--seq-len", "16")
    assert_one_line_error(code, err, 2, "loading the model needs ")
    assert f"{need / 1024:.1f} KiB of memory as float32 weights, and 9.8 KiB is available (MemAvailable + " in err
    assert "ACCEL_MEMORY_CHECK=off" in err


def test_an_out_dir_names_the_packed_alternative_and_the_check_can_be_turned_off(
        capsys, tiny_llama, text_file, tmp_path, monkeypatch):
    out = tmp_path / "q"
    assert run(capsys, "quantize", tiny_llama, "--weights", "rtn4", "--out", out)[0] == 0
    monkeypatch.setattr(accel.memory, "available_bytes", lambda: (10_000, "MemAvailable + SwapFree"))
    code, _, err = run(capsys, "eval", out, "--data", text_file, "--windows", "1", "--seq-len", "16")
    assert_one_line_error(code, err, 2, "decoding the model needs")
    assert "--kernels keeps its quantized weights packed" in err
    monkeypatch.setenv("ACCEL_MEMORY_CHECK", "off")
    assert run(capsys, "eval", out, "--data", text_file, "--windows", "1", "--seq-len", "16")[0] == 0


def test_a_model_that_fits_is_loaded(capsys, tiny_llama, text_file, monkeypatch):
    need = None

    def fake_available():
        return need, "MemAvailable + SwapFree"

    monkeypatch.setattr(accel.memory, "available_bytes", fake_available)
    from accel.converters import open_model

    with open_model(tiny_llama) as source:
        need = float32_bytes(source.tensor_shapes().values())  # exactly enough
    assert run(capsys, "eval", tiny_llama, "--data", text_file, "--windows", "1", "--seq-len", "16")[0] == 0


def test_a_container_limit_is_named_when_it_is_the_smaller(capsys, tiny_llama, text_file, tmp_path, monkeypatch):
    """In a container /proc/meminfo shows the host: the cgroup's limit is what the OOM killer enforces."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO)  # 22 GiB available on the "host"
    (tmp_path / "cg").mkdir()
    (tmp_path / "cg" / "memory.max").write_text("100000\n")
    (tmp_path / "cg" / "memory.current").write_text("90000\n")
    monkeypatch.setattr(accel.memory, "MEMINFO", meminfo)
    monkeypatch.setattr(accel.memory, "CGROUP", tmp_path / "cg")
    code, _, err = run(capsys, "eval", tiny_llama, "--data", text_file, "--windows", "1", "--seq-len", "16")
    assert_one_line_error(code, err, 2, "of memory as float32 weights, and 9.8 KiB is available (the memory "
                                        "cgroup's limit less its use)")
