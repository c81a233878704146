"""bench/kernel_ab.py: this checkout's kernels against a git revision's, side by side."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/kernel_ab.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)


def _in_git_checkout() -> bool:
    run = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, check=False)
    return run.returncode == 0


@pytest.mark.parametrize("args,message", [(["--rev", "no-such-revision"], "git rev-parse"),
                                          (["--shapes", "4096by4096"], "--shapes"),
                                          (["--kernels", "int3"], "--kernels")])
def test_bad_input_is_one_line_and_exit_2(args, message):
    if args[0] == "--rev" and not _in_git_checkout():
        pytest.skip("not a git checkout")
    run = _run(*args)
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("error: ") and message in run.stderr and "Traceback" not in run.stderr


def test_head_against_itself_agrees_bit_for_bit():
    """The revision's library is built from git's copy of the sources (a second build, a few seconds): at HEAD the
    two arms compute the same bits, and both are timed."""
    if not _in_git_checkout():
        pytest.skip("not a git checkout")
    run = _run("--rev", "HEAD", "--kernels", "int4,base3", "--shapes", "64x200", "--threads", "1", "--footprint",
               "0", "--seconds", "0.05", "--json", timeout=600)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.splitlines()[-1])
    assert [(r["shape"], r["kernel"]) for r in result["rows"]] == [("64x200", "int4"), ("64x200", "base3")]
    for r in result["rows"]:
        assert r["relative_difference"] == 0.0 and r["us_base"] > 0 and r["us_new"] > 0
