"""Train the two trained hybrid fixtures, `tiny-gdn` and `tiny-kda`, on real text; seeded.

    .venv/bin/python scripts/train_fixtures.py [--only gdn|kda] [--steps N] [--threads T] [--probe] [--measure]

- tiny-gdn: transformers' Qwen3.5 text architecture (`qwen3_5_text`): three Gated DeltaNet layers and one
  full-attention layer (gated GQA), dense SwiGLU MLPs.
- tiny-kda: transformers' Kimi-Linear architecture (`kimi_linear`): three Kimi Delta Attention layers and one
  full-attention (MLA, NoPE) layer, dense MLPs only (no MoE).
- Both: hidden 256, SwiGLU width 512, 4 layers, linear-attention heads of 64×64 state (GDN: 2 key heads shared
  by 4 value heads; KDA: 4 heads), about 2.8M (GDN) and 2.9M (KDA) parameters, the same byte-level tokenizer
  (256 byte tokens + `<|endoftext|>`), untied embeddings.
- Text: `accel.fixtures.corpus` (pydoc topics with every tenth block held out, plus the Debian license texts).
  Training draws random 512-token windows with a seeded generator; AdamW, linear warm-up, cosine decay.
- After training the weights are rounded to float16 and the held-out perplexity is measured on the rounded model
  (teacher-forced, non-overlapping 512-token windows), next to the byte-unigram perplexity of the same text
  (add-one-smoothed byte frequencies of the training text). Both figures go to `<fixture>/training.json`;
  `--measure` re-measures them for the committed fixtures without training.

The fixtures train one after the other in one process on `--threads` threads (default 2, this machine's cores);
never run two training processes with two threads each side by side: on this two-core machine they slow each
other down by 50×. `--probe` times a few steps and exits.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from accel.fixtures.corpus import heldout_text, train_text

FIXTURES = ROOT / "accel" / "fixtures"
EOT = "<|endoftext|>"
SEQ_LEN = 512
BATCH = 4


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (the alphabet of the ByteLevel pre-tokenizer)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


def byte_tokenizer():
    """A byte-level tokenizer: one token per UTF-8 byte (GPT-2's byte-to-unicode alphabet), no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # order the 256 symbols by the byte they stand for, so token id == byte value
    byte_to_char = bytes_to_unicode()
    assert sorted(byte_to_char.values()) == sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, bos_token=EOT, pad_token=EOT)


def fast_chunk_kda(query, key, value, g, beta, chunk_size=16, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' `chunk_kimi_delta_attention`, same math, for training speed only.

    Two changes: chunks of 16 instead of 64 (the per-channel decay mask is chunk² × d_k per chunk), and the
    unit-lower-triangular system is solved with `torch.linalg.solve_triangular` instead of a Python loop over
    rows (as transformers' own GDN path does). `check_fast_kda` pins it to the stock function before training;
    the saved model is evaluated with the stock code.
    """
    import torch.nn.functional as F
    from transformers.models.kimi_linear.modeling_kimi_linear import l2norm

    dtype = query.dtype
    query, key, value, beta, g = [x.transpose(1, 2).contiguous().to(torch.float32)
                                  for x in (query, key, value, beta, g)]
    if use_qk_l2norm_in_kernel:
        query = l2norm(query, dim=-1, eps=1e-6)
        key = l2norm(key, dim=-1, eps=1e-6)
    b, h, t, dk = key.shape
    dv = value.shape[-1]
    pad = (chunk_size - t % chunk_size) % chunk_size
    query = F.pad(query, (0, 0, 0, pad)) * dk**-0.5
    key, value, g = (F.pad(x, (0, 0, 0, pad)) for x in (key, value, g))
    beta = F.pad(beta, (0, pad))
    n = (t + pad) // chunk_size
    query, key, value, g = (x.reshape(b, h, n, chunk_size, x.shape[-1]) for x in (query, key, value, g))
    beta = beta.reshape(b, h, n, chunk_size, 1)
    k_beta, v_beta = key * beta, value * beta
    g = g.cumsum(dim=-2)
    strict_upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool).triu(1)
    decay = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(strict_upper[..., None], float("-inf")).exp()
    system = (k_beta.unsqueeze(-2) * key.unsqueeze(-3) * decay).sum(-1)
    system = system.masked_fill(~torch.ones(chunk_size, chunk_size, dtype=torch.bool).tril(-1), 0.0)
    system = system + torch.eye(chunk_size)
    value = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * g.exp(), upper=False, unitriangular=True)
    intra = (query.unsqueeze(-2) * key.unsqueeze(-3) * decay).sum(-1)
    state = (torch.zeros(b, h, dk, dv) if initial_state is None else initial_state.to(torch.float32))
    outs = []
    for i in range(n):
        q_i, k_i, g_i = query[:, :, i], key[:, :, i], g[:, :, i]
        v_new = value[:, :, i] - k_cumdecay[:, :, i] @ state
        outs.append((q_i * g_i.exp()) @ state + intra[:, :, i] @ v_new)
        state = state * g_i[:, :, -1].exp().unsqueeze(-1) + (k_i * (g_i[:, :, -1:] - g_i).exp()).transpose(-1, -2) @ v_new
    out = torch.stack(outs, dim=2).reshape(b, h, -1, dv)[:, :, :t].transpose(1, 2).contiguous().to(dtype)
    return out, (state if output_final_state else None)


def check_fast_kda() -> None:
    from transformers.models.kimi_linear import modeling_kimi_linear as mk

    gen = torch.Generator().manual_seed(0)
    b, t, h, d = 2, 100, 3, 8
    q, k, v = (torch.randn(b, t, h, d, generator=gen) for _ in range(3))
    g = -torch.rand(b, t, h, d, generator=gen) * 0.5
    beta = torch.rand(b, t, h, generator=gen)
    s0 = torch.randn(b, h, d, d, generator=gen)
    ref = mk.chunk_kimi_delta_attention(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True)
    new = fast_chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    for a, c in zip(ref, new):
        err = float((a - c).abs().max() / a.abs().max())
        if err > 1e-4:
            raise SystemExit(f"fast_chunk_kda disagrees with transformers' chunk_kimi_delta_attention: {err:.2e}")


def fla_gate_init(model, seed: int) -> None:
    """Gated DeltaNet decay gates as flash-linear-attention (and Mamba2) initialise them: A ~ U(1, 16) and
    dt_bias = softplus⁻¹(dt) with dt log-uniform in [1e-3, 1e-1], so g = -A·softplus(a + dt_bias) starts between
    about -1.6 and -0.001 (memories of one to a thousand tokens). transformers' from-scratch init of Qwen3.5 sets
    dt_bias = 1 instead, which makes nearly every head forget within a token and stay that way (the first tiny-gdn
    trained like that ended with mean log decays of -4 to -18 in 11 of 12 heads). Kimi-Linear's init already
    follows FLA."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "A_log") and hasattr(module, "dt_bias") and module.dt_bias.dim() == 1:
                n = module.A_log.numel()
                module.A_log.copy_(torch.log(torch.empty(n).uniform_(1.0, 16.0, generator=gen)))
                dt = torch.exp(torch.empty(n).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
                module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))


def gdn_config(vocab: int):
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "qwen3_5_text", vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, max_position_embeddings=2048, tie_word_embeddings=False,
        bos_token_id=256, eos_token_id=256, pad_token_id=256, rms_norm_eps=1e-6)


def kda_config(vocab: int):
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "kimi_linear", vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        mlp_layer_types=["dense"] * 4, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=16, v_head_dim=64,
        linear_num_heads=4, linear_head_dim=64, linear_conv_kernel_dim=4, model_max_length=2048,
        tie_word_embeddings=False, bos_token_id=256, eos_token_id=256, pad_token_id=256, rms_norm_eps=1e-5)


# default steps: about 18 and 23 minutes on two threads of this machine (0.6 s and 1.16 s a step)
ARCHS = {"gdn": ("tiny-gdn", gdn_config, 1800), "kda": ("tiny-kda", kda_config, 1200)}


def encode(tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)


def unigram_ppl(train_ids: np.ndarray, test_ids: np.ndarray, vocab: int) -> float:
    counts = np.bincount(train_ids, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(np.exp(-logp[test_ids].mean()))


@torch.inference_mode()
def heldout_ppl(model, ids: np.ndarray, seq_len: int = SEQ_LEN) -> tuple[float, int]:
    n = ids.size // seq_len
    windows = torch.from_numpy(ids[: n * seq_len].reshape(n, seq_len))
    total, count = 0.0, 0
    for w in windows:
        logits = model(input_ids=w[None]).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum")
        total += float(nll)
        count += seq_len - 1
    return math.exp(total / count), n


def save_fixture(model, tokenizer, out: Path, info: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*"):
        stale.unlink()
    tensors = {name: p.detach().to(torch.float16).contiguous() for name, p in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    for key in ("transformers_version", "_name_or_path", "architectures"):
        config.pop(key, None)
    config["dtype"] = "float16"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(str(out))
    (out / "training.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def rounded_copy(model, config):
    """The model as it will be loaded from the committed float16 file (weights rounded, compute float32)."""
    from transformers import AutoModelForCausalLM

    copy = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.to(torch.float16).to(torch.float32) for k, v in model.state_dict().items()}
    copy.load_state_dict(state)
    return copy.eval()


def train(arch: str, steps: int, seed: int, probe: bool) -> dict:
    if arch == "kda":
        from transformers.models.kimi_linear import modeling_kimi_linear

        check_fast_kda()
        stock = modeling_kimi_linear.chunk_kimi_delta_attention
        modeling_kimi_linear.chunk_kimi_delta_attention = fast_chunk_kda
        try:
            return _train(arch, steps, seed, probe, restore=lambda: setattr(
                modeling_kimi_linear, "chunk_kimi_delta_attention", stock))
        finally:
            modeling_kimi_linear.chunk_kimi_delta_attention = stock
    return _train(arch, steps, seed, probe, restore=lambda: None)


def _train(arch: str, steps: int, seed: int, probe: bool, restore) -> dict:
    from transformers import AutoModelForCausalLM

    name, make_config, _ = ARCHS[arch]
    torch.manual_seed(seed)
    tokenizer = byte_tokenizer()
    vocab = len(tokenizer)
    config = make_config(vocab)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "gdn":
        fla_gate_init(model, seed)
    params = sum(p.numel() for p in model.parameters())
    train_ids = encode(tokenizer, train_text())
    test_ids = encode(tokenizer, heldout_text())
    print(f"{name}: {config.model_type}, {params:,} parameters, {train_ids.size:,} training tokens, "
          f"{test_ids.size:,} held-out tokens", file=sys.stderr)

    rng = np.random.default_rng(seed)
    decay, no_decay = [], []
    for pname, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in pname or "A_log" in pname or "dt_bias" in pname else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95))
    warmup = max(1, steps // 30)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    started = time.perf_counter()
    log = []
    for step in range(steps if not probe else 6):
        starts = rng.integers(0, train_ids.size - SEQ_LEN - 1, size=BATCH)
        batch = torch.from_numpy(np.stack([train_ids[s : s + SEQ_LEN + 1] for s in starts]))
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                 batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if probe:
            print(f"step {step}: loss {loss.item():.3f}, {time.perf_counter() - started:.2f} s", file=sys.stderr)
        elif step % 100 == 0 or step == steps - 1:
            elapsed = time.perf_counter() - started
            log.append({"step": step, "loss": round(float(loss), 4), "seconds": round(elapsed, 1)})
            print(f"{name} step {step}/{steps}: loss {loss.item():.3f} ({elapsed / (step + 1):.3f} s/step)",
                  file=sys.stderr, flush=True)
    if probe:
        return {}
    seconds = time.perf_counter() - started
    restore()  # the held-out figure comes from transformers' own code
    model.eval()
    rounded = rounded_copy(model, config)
    ppl, windows = heldout_ppl(rounded, test_ids)
    info = {
        "fixture": name, "model_type": config.model_type, "parameters": params, "seed": seed, "steps": steps,
        "batch": BATCH, "seq_len": SEQ_LEN, "train_tokens": int(train_ids.size), "seconds": round(seconds, 1),
        "threads": torch.get_num_threads(), "heldout_tokens": int(test_ids.size), "heldout_windows": windows,
        "heldout_ppl_float16": round(ppl, 4),
        "unigram_ppl": round(unigram_ppl(train_ids, test_ids, vocab), 4), "log": log,
    }
    save_fixture(model, tokenizer, FIXTURES / name, info)
    print(json.dumps({k: v for k, v in info.items() if k != "log"}), file=sys.stderr)
    return info


def measure(arch: str) -> dict:
    """Re-measure the held-out and unigram perplexities of a committed fixture (float16 weights, float32 compute,
    transformers' own code) and record them in its training.json."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = ARCHS[arch][0]
    out = FIXTURES / name
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    train_ids, test_ids = encode(tokenizer, train_text()), encode(tokenizer, heldout_text())
    ppl, windows = heldout_ppl(model, test_ids)
    info = json.loads((out / "training.json").read_text())
    info.update({"heldout_tokens": int(test_ids.size), "heldout_windows": windows,
                 "heldout_ppl_float16": round(ppl, 4), "unigram_ppl": round(unigram_ppl(train_ids, test_ids,
                                                                                       len(tokenizer)), 4)})
    (out / "training.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return {k: info[k] for k in ("fixture", "heldout_tokens", "heldout_ppl_float16", "unigram_ppl")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(ARCHS))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    parser.add_argument("--probe", action="store_true", help="time a few steps and exit")
    parser.add_argument("--measure", action="store_true",
                        help="only re-measure the committed fixtures' held-out figures (into training.json)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    if args.measure:
        print(json.dumps({arch: measure(arch) for arch in ([args.only] if args.only else sorted(ARCHS))}))
        return
    for arch in [args.only] if args.only else sorted(ARCHS):
        steps = args.steps if args.steps is not None else ARCHS[arch][2]
        results[arch] = train(arch, steps, args.seed, args.probe)
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "log"} for k, v in results.items()}))


if __name__ == "__main__":
    main()
