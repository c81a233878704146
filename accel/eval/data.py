"""Evaluation and calibration text: read, validate, tokenize into non-overlapping windows."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from accel.errors import AccelError


def read_text(path: Path) -> str:
    """A UTF-8 text file with some non-whitespace content, or a one-line AccelError. A leading byte-order mark
    (Windows editors write one) is file metadata, not text: it is dropped, as Python's utf-8-sig codec does."""
    path = Path(path)
    if not path.exists():
        raise AccelError(f"--data {path}: no such file")
    if not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise AccelError(f"--data {path}: {kind}; give a UTF-8 text file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise AccelError(f"--data {path}: not UTF-8 text (bad byte at offset {exc.start})") from None
    if not text.strip():
        raise AccelError(f"--data {path}: the file is empty")
    return text


def check_window_args(seq_len: int, windows: int | None) -> None:
    if seq_len < 2:
        raise AccelError(f"--seq-len must be at least 2, got {seq_len}")
    if windows is not None and windows < 1:
        raise AccelError(f"--windows must be at least 1, got {windows}")


def max_positions(config: dict) -> int | None:
    """The positions the model was built for (max_position_embeddings), None when the config does not say."""
    limit = config.get("max_position_embeddings")
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def check_context(seq_len: int, config: dict, what: str = "the model") -> None:
    """Refuse windows longer than the positions the model was built for: what it computes there is not what it was
    trained to."""
    limit = max_positions(config)
    if limit is not None and seq_len > limit:
        raise AccelError(f"--seq-len {seq_len} is longer than {what}'s {limit} positions (max_position_embeddings)")


def token_windows(tokenizer, text: str, seq_len: int, windows: int | None) -> np.ndarray:
    """Token ids as (n, seq_len) int64: consecutive non-overlapping windows from the start of the text."""
    check_window_args(seq_len, windows)
    ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
    available = ids.size // seq_len
    if available == 0:
        raise AccelError(f"the text has {ids.size} tokens, fewer than one window of --seq-len {seq_len}")
    n = available if windows is None else min(windows, available)
    return ids[: n * seq_len].reshape(n, seq_len)


def pydoc_text() -> str:
    """The development corpus: every CPython's pydoc_data.topics (about 465 KB of English), in a fixed order."""
    from pydoc_data import topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
