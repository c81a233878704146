"""`accel generate`: greedy decoding equal to recomputing the whole sequence, through the quantized caches and the
fused kernels, with the CLI contract (--json keys, one-line errors)."""

from __future__ import annotations

import json

import pytest
import torch

from accel.cli.main import main
from accel.eval.generate import GenerateSettings, eos_ids, generate, greedy_tokens
from accel.eval.load import load_causal_lm

PROMPT = "The for statement is used to"


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def rtn4(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("q") / "rtn4"
    assert main(["quantize", str(tiny_llama), "--weights", "rtn4", "--out", str(out)]) == 0
    return out


@torch.inference_mode()
def _recomputed(model, prompt_ids: list[int], tokens: int) -> list[int]:
    """Greedy tokens with no cache: every step runs the whole sequence again."""
    ids = list(prompt_ids)
    for _ in range(tokens):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


def test_cached_greedy_equals_recomputing_the_sequence(tiny_llama):
    loaded = load_causal_lm(tiny_llama)
    prompt_ids = loaded.tokenizer(PROMPT)["input_ids"]
    run = greedy_tokens(loaded.model, prompt_ids, 12)
    assert run["ids"] == _recomputed(loaded.model, prompt_ids, 12)
    assert run["stopped"] == "length" and len(run["ids"]) == 12


def test_generation_stops_at_the_end_of_text_token(tiny_llama):
    loaded = load_causal_lm(tiny_llama)
    prompt_ids = loaded.tokenizer(PROMPT)["input_ids"]
    free = greedy_tokens(loaded.model, prompt_ids, 6)["ids"]
    stopped = greedy_tokens(loaded.model, prompt_ids, 6, stop={free[2]})  # as if the third token ended the text
    assert stopped["ids"] == free[:3] and stopped["stopped"] == "eos"
    assert eos_ids(loaded.tokenizer, {"eos_token_id": [7, 9]}) == {7, 9, loaded.tokenizer.eos_token_id}


def test_state_map_is_read_at_every_step():
    """A lossless state format through the state cache gives the plain path's tokens; INT2 storage changes them."""
    plain = generate("tiny-gdn", GenerateSettings(PROMPT, tokens=24))
    fp32 = generate("tiny-gdn", GenerateSettings(PROMPT, tokens=24, state="fp32"))
    int2 = generate("tiny-gdn", GenerateSettings(PROMPT, tokens=24, state="int:2"))
    assert fp32["token_ids"] == plain["token_ids"]
    assert int2["token_ids"] != plain["token_ids"]
    assert int2["state_bits_per_value"] == pytest.approx(2 + 16 / 64)
    assert fp32["state_bytes"] == fp32["state_fp32_bytes"] and "state_bytes" not in plain


def test_kv_map_is_read_and_its_bytes_reported(tiny_llama):
    plain = generate(tiny_llama, GenerateSettings(PROMPT, tokens=16, ignore_eos=True))
    fp16 = generate(tiny_llama, GenerateSettings(PROMPT, tokens=16, ignore_eos=True, kv="fp16"))
    coarse = generate(tiny_llama, GenerateSettings(PROMPT, tokens=16, ignore_eos=True, kv="affine:3"))
    assert fp16["kv_bytes_per_token"] == fp16["kv_fp16_bytes_per_token"]
    assert coarse["kv_bytes_per_token"] < coarse["kv_fp16_bytes_per_token"]
    assert coarse["token_ids"] != plain["token_ids"]
    assert len(fp16["token_ids"]) == len(plain["token_ids"]) == 16


def test_kernels_give_the_dense_tokens(rtn4):
    dense = generate(rtn4, GenerateSettings(PROMPT, tokens=16, ignore_eos=True))
    fused = generate(rtn4, GenerateSettings(PROMPT, tokens=16, ignore_eos=True, kernels=True))
    assert fused["token_ids"] == dense["token_ids"] and fused["kernels"] and not dense["kernels"]


def test_cli_json_and_text(capsys, tiny_llama):
    code, out, err = run(capsys, "generate", tiny_llama, "--prompt", PROMPT, "--tokens", "5", "--ignore-eos",
                         "--json")
    assert code == 0, err
    doc = json.loads(out.strip().splitlines()[-1])
    assert {"text", "token_ids", "tokens", "stopped", "prompt_tokens", "prefill_seconds",
            "tokens_per_second"} <= doc.keys()
    assert doc["tokens"] == len(doc["token_ids"]) == 5 and doc["stopped"] == "length"
    code, out2, err = run(capsys, "generate", tiny_llama, "--prompt", PROMPT, "--tokens", "5", "--ignore-eos")
    assert code == 0 and out2.rstrip("\n") == PROMPT + doc["text"]
    assert "5 tokens" in err and "tokens/s" in err


@pytest.mark.parametrize("args,message", [
    (["--tokens", "0"], "--tokens must be at least 1"),
    (["--tokens", "100000"], "exceed the model's 512 positions"),
    (["--kernels"], "--kernels serves an accel OUT_DIR"),
    (["--state", "damp:abc"], "damp"),
])
def test_cli_bad_input_is_one_line(capsys, tiny_llama, args, message):
    code, _, err = run(capsys, "generate", tiny_llama, "--prompt", PROMPT, *args)
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0] and "Traceback" not in err


def test_generation_may_fill_every_position(capsys, tiny_llama):
    """The last new token is returned, never fed back: prompt + tokens - 1 positions are read, so a request that
    ends exactly at the limit runs (it was refused one token early)."""
    from transformers import AutoTokenizer

    prompt = "x " * 230
    n = len(AutoTokenizer.from_pretrained(str(tiny_llama))(prompt)["input_ids"])
    assert n < 512
    args = ["--prompt", prompt, "--ignore-eos", "--json"]
    code, out, err = run(capsys, "generate", tiny_llama, *args, "--tokens", str(512 - n + 1))
    assert code == 0 and json.loads(out)["tokens"] == 512 - n + 1, err
    code, _, err = run(capsys, "generate", tiny_llama, *args, "--tokens", str(512 - n + 2))
    assert code == 2 and "exceed the model's 512 positions" in err


def test_cli_empty_prompt_is_refused(capsys, tiny_llama):
    code, _, err = run(capsys, "generate", tiny_llama, "--prompt", "")
    assert code == 2 and "--prompt is empty" in err
