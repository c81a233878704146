"""JSON text from files accel reads: json.loads, with every way the text can be bad raised as a JSONDecodeError.

json.loads itself raises RecursionError on deep nesting (not a ValueError) and accepts escaped lone surrogates
("\\ud800") that no UTF-8 writer or terminal can print later; both become JSONDecodeError here, so a caller's one
`except ValueError` (or JSONDecodeError) covers a damaged file.
"""

from __future__ import annotations

import json
from typing import Any


def loads(text: str | bytes) -> Any:
    """Parse JSON text (bytes are decoded as UTF-8; a bad byte raises UnicodeDecodeError, also a ValueError)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    try:
        value = json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text, 0) from None
    if "\\u" in text:  # only an escape can smuggle in a lone surrogate: UTF-8 decoding refuses raw ones
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise json.JSONDecodeError("an escape names a lone surrogate", text, 0) from None
        except RecursionError:
            raise json.JSONDecodeError("nested too deeply", text, 0) from None
    return value
