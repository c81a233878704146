"""GGUF files (llama.cpp): memory-mapped, dequantized to float32 one tensor at a time, under HF names.

The llama (Llama, Mistral: llama.cpp converts both as "llama"; Mixtral, a llama file with experts), qwen2, qwen3,
qwen2moe and qwen3moe architectures are mapped. Stacked experts (`ffn_gate_exps`, [experts, rows, columns]) are
listed under the published per-expert checkpoint names (`block_sparse_moe.experts.<e>.w1`, `mlp.experts.<e>.
gate_proj`, ...), each one slice of its GGUF tensor, so the model is built from them as from a published Hugging
Face checkpoint (MOE_ARCHITECTURES). For
llama, llama.cpp's converter permutes the rows of the Q and K projections (it interleaves the two rotary halves of
every head); `unpermute_qk` undoes it, as transformers' GGUF loader does. Qwen2/Qwen3 are written unpermuted (their
rotary embedding is the same rotate-half as transformers').
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any

import numpy as np

from accel.converters.gguf_header import GGUFArray, GGUFHeader
from accel.converters.sources import ModelSource, config_json_bytes, one_line
from accel.errors import AccelError, FormatError
from accel.formats.container import drop_resident
from accel.memory import row_passes

_FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}

# GGUF block name -> Hugging Face module path (llama, qwen2; qwen3 adds the q/k norms).
_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


@dataclass(frozen=True)
class _MoE:
    """A mixture-of-experts GGUF architecture as its published Hugging Face checkpoints name it: the router's module,
    the experts' module and each projection's name under `<experts>.<e>.`, and any other block tensors (a shared
    expert). Experts come stacked (`ffn_gate_exps`) or, from older converters, one tensor an expert."""

    model_type: str
    hf_class: str
    router: str
    experts: str
    projections: dict[str, str]
    extra: dict[str, str] = dataclass_field(default_factory=dict)


_QWEN_EXPERTS = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
MOE_ARCHITECTURES = {
    "llama": _MoE("mixtral", "MixtralForCausalLM", "block_sparse_moe.gate", "block_sparse_moe.experts",
                  {"ffn_gate": "w1", "ffn_up": "w3", "ffn_down": "w2"}),  # Mixtral: a llama file with experts
    "qwen2moe": _MoE("qwen2_moe", "Qwen2MoeForCausalLM", "mlp.gate", "mlp.experts", _QWEN_EXPERTS,
                     {"ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                      "ffn_down_shexp": "mlp.shared_expert.down_proj",
                      "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}),
    "qwen3moe": _MoE("qwen3_moe", "Qwen3MoeForCausalLM", "mlp.gate", "mlp.experts", _QWEN_EXPERTS),
}
_STACKED_RE = re.compile(r"blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)_exps\.weight")
_PER_EXPERT_RE = re.compile(r"blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight")
_LLAMA_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Elements of a quantized tensor dequantized at a time (`GGUFSource._dequantized`).
DEQUANTIZE_ELEMENTS = 1 << 20

# GGUF architecture -> (model_type, the transformers class), as config.json names them.
HF_ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
                    "qwen3": ("qwen3", "Qwen3ForCausalLM"), "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
                    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM")}
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's Llama 3 rope scaling, one divisor per rotary frequency
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
_TOP_RE = re.compile(r"([a-z_]+)\.(weight|bias)")


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute(w, n_head, n_head_kv)` on Q/K rows (n_head = the heads this projection has).

    llama.cpp reorders each head's rows from [half0 | half1] to interleaved pairs; this restores HF's order.
    """
    rows = weight.shape[0]
    half = rows // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's own permutation (convert_hf_to_gguf.LlamaModel.permute), the inverse of `unpermute_qk`."""
    rows = weight.shape[0]
    half = rows // n_head // 2
    return weight.reshape(n_head, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@dataclass(frozen=True)
class _Entry:
    gguf_name: str
    shape: tuple[int, ...]  # HF (PyTorch) orientation
    dtype: str
    qk_heads: int | None  # set for Q/K projections: the head count to unpermute with
    expert: int | None = None  # set for one expert's slice of a stacked experts tensor


def _scalar(header: GGUFHeader, key: str, default: Any = None) -> Any:
    """One scalar metadata value (int, float, bool or str), or `default` when absent."""
    value = header.fields.get(key, default)
    if isinstance(value, GGUFArray):
        raise AccelError(f"{header.path}: GGUF metadata {key!r} is an array; one value was expected")
    return value


def _float32_shortest(value: float) -> float:
    """The shortest decimal that is the same float32, e.g. 9.999999747e-06 -> 1e-05 (both are one float32)."""
    return float(str(np.float32(value)))


class GGUFSource(ModelSource):
    """A .gguf file of a supported architecture, seen as a Hugging Face model."""

    SUPPORTED_ARCHITECTURES = tuple(HF_ARCHITECTURES)

    def __init__(self, path: Path, name: str | None = None):
        self.path = Path(path).absolute()
        self.name = name if name is not None else str(path)
        try:
            self._header = GGUFHeader(self.path)
        except Exception as err:  # GGUFHeaderError names what is damaged and where; OSError
            raise FormatError(f"{self.path}: not a valid GGUF file: {one_line(err)}") from err

        self.architecture = str(_scalar(self._header, "general.architecture", ""))
        if self.architecture not in self.SUPPORTED_ARCHITECTURES:
            raise AccelError(
                f"{self.path}: GGUF architecture {self.architecture!r} is not supported "
                f"(supported: {', '.join(self.SUPPORTED_ARCHITECTURES)})"
            )
        self._tensors = {t.name: t for t in self._header.tensors}
        self.config = self._llama_config()
        self._entries = self._llama_entries()
        self._names = sorted(self._entries)
        self.input_files = [self.path]
        self._tokenizer = None
        tokens = self._header.fields.get("tokenizer.ggml.tokens")
        self._has_tokenizer = isinstance(tokens, GGUFArray)
        self._vocab = tokens.count if self._has_tokenizer else 0
        # the header and metadata, up to the end of the last entry: what transformers' tokenizer conversion reads,
        # the tokenizer cache's key
        self._metadata_end = self._header.metadata_end

    # --- llama ---------------------------------------------------------------------------------------------

    def _meta(self, key: str, default: Any = None, required: bool = False) -> Any:
        value = _scalar(self._header, f"{self.architecture}.{key}", default)
        if value is None and required:
            raise FormatError(f"{self.path}: GGUF metadata {self.architecture}.{key} is missing")
        return value

    def _llama_config(self) -> dict[str, Any]:
        hidden = int(self._meta("embedding_length", required=True))
        n_head = int(self._meta("attention.head_count", required=True))
        n_kv = int(self._meta("attention.head_count_kv", n_head))
        if n_head <= 0 or n_kv <= 0 or n_head % n_kv:
            raise FormatError(f"{self.path}: {n_head} attention heads cannot share {n_kv} key/value heads")
        head_dim = (
            self._meta("attention.key_length") or self._meta("rope.dimension_count") or hidden // n_head
        )
        arch = self.architecture
        scaling = self._meta("rope.scaling.type")
        if scaling not in (None, "none"):
            raise AccelError(f"{self.path}: {arch} GGUF with rope scaling {scaling!r} is not supported yet")
        experts = int(self._meta("expert_count", 0) or 0)
        if arch.endswith("moe") and not experts:
            raise FormatError(f"{self.path}: a {arch} GGUF file without {arch}.expert_count")
        if experts and arch not in MOE_ARCHITECTURES:
            raise AccelError(f"{self.path}: a {arch} GGUF file with experts is not supported (mixture-of-experts "
                             f"architectures: {', '.join(MOE_ARCHITECTURES)})")

        embed = self._tensors.get("token_embd.weight")
        if embed is None:
            raise FormatError(f"{self.path}: no token_embd.weight tensor")
        if len(embed.shape) != 2:
            raise FormatError(f"{self.path}: token_embd.weight has {len(embed.shape)} dimensions, not 2")
        vocab = embed.shape[1]  # GGUF lists dimensions innermost first
        meta_vocab = self._meta("vocab_size")
        if meta_vocab is not None and int(meta_vocab) != vocab:
            raise FormatError(f"{self.path}: vocab_size {meta_vocab} but token_embd.weight has {vocab} rows")

        names = self._tensors
        moe = MOE_ARCHITECTURES[arch] if experts else None
        model_type, hf_class = (moe.model_type, moe.hf_class) if moe else HF_ARCHITECTURES[arch]
        config: dict[str, Any] = {
            "architectures": [hf_class],
            "model_type": model_type,
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": int(self._meta("feed_forward_length", required=True)),
            "num_hidden_layers": int(self._meta("block_count", required=True)),
            "num_attention_heads": n_head,
            "num_key_value_heads": n_kv,
            "head_dim": int(head_dim),
            "hidden_act": "silu",
            "max_position_embeddings": int(self._meta("context_length", 2048)),
            "rms_norm_eps": _float32_shortest(self._meta("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": _float32_shortest(self._meta("rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in names,
        }
        scaling = self._rope_scaling(config["rope_theta"], int(head_dim), config["max_position_embeddings"])
        if scaling is not None:
            config["rope_scaling"] = scaling
        block_biases = {n.split(".")[2] for n in names if n.startswith("blk.") and n.endswith(".bias")}
        if experts:
            used = int(self._meta("expert_used_count", required=True))
            if not 0 < used <= experts:
                raise FormatError(f"{self.path}: expert_used_count {used} with {experts} experts")
            config["num_experts_per_tok"] = used
        if arch == "llama" and experts:
            if block_biases:
                raise AccelError(f"{self.path}: a Mixtral GGUF file with biases ({min(block_biases)}) is not "
                                 f"supported")
            config.update(num_local_experts=experts, sliding_window=None)
        elif arch in ("qwen2moe", "qwen3moe"):  # every layer sparse, as llama.cpp runs them
            config.update(num_experts=experts, decoder_sparse_step=1, mlp_only_layers=[],
                          moe_intermediate_size=int(self._meta("expert_feed_forward_length", required=True)),
                          norm_topk_prob=arch == "qwen3moe")  # llama.cpp renormalizes Qwen3-MoE's top k only
            if arch == "qwen2moe":
                config["shared_expert_intermediate_size"] = int(
                    self._meta("expert_shared_feed_forward_length", required=True))
                config["use_sliding_window"] = False
            else:
                config["attention_bias"] = bool(block_biases & {"attn_q", "attn_k", "attn_v", "attn_output"})
        elif arch in ("llama", "qwen3"):  # qwen2's q/k/v biases are part of its class, not of its config
            config["attention_bias"] = bool(block_biases & {"attn_q", "attn_k", "attn_v", "attn_output"})
        if arch == "llama" and not experts:
            config["mlp_bias"] = any(b.startswith("ffn_") for b in block_biases)
        if arch == "qwen2":
            config["use_sliding_window"] = False  # llama.cpp runs Qwen2 with full attention in every layer
        for key, hf_key in (
            ("bos_token_id", "bos_token_id"),
            ("eos_token_id", "eos_token_id"),
            ("padding_token_id", "pad_token_id"),
        ):
            value = _scalar(self._header, f"tokenizer.ggml.{key}")
            if value is not None:
                config[hf_key] = int(value)
        return config

    def _rope_scaling(self, theta: float, head_dim: int, context: int) -> dict[str, Any] | None:
        """Llama 3's rope scaling, from the divisors llama.cpp stores in place of its parameters (gguf_rope.py)."""
        from accel.converters.gguf_rope import llama3_rope_scaling

        if ROPE_FREQS not in self._tensors:
            return None
        if self.architecture != "llama":
            raise AccelError(f"{self.path}: {ROPE_FREQS} in a {self.architecture} GGUF file is not supported")
        try:
            return llama3_rope_scaling(self._dequantized(ROPE_FREQS), theta, head_dim, context)
        except AccelError as err:
            raise AccelError(f"{self.path}: {err}") from None

    def _layer(self, gguf_name: str, layer: str) -> int:
        if int(layer) >= self.config["num_hidden_layers"]:
            raise FormatError(f"{self.path}: tensor {gguf_name} is beyond block_count")
        return int(layer)

    @property
    def _moe(self) -> _MoE | None:
        return MOE_ARCHITECTURES[self.architecture] if "num_experts_per_tok" in self.config else None

    @property
    def _expert_count(self) -> int:
        return self.config.get("num_local_experts", self.config.get("num_experts"))

    def _hf_name(self, gguf_name: str) -> str:
        qk_norms = self.architecture in ("qwen3", "qwen3moe")
        block = {**_LLAMA_BLOCK, **_QK_NORMS} if qk_norms else _LLAMA_BLOCK
        moe = self._moe
        if moe is not None:  # no dense MLP: ffn_gate/ffn_up/ffn_down are experts
            block = {k: v for k, v in block.items() if k not in moe.projections}
            block.update({"ffn_gate_inp": moe.router, **moe.extra})
            match = _PER_EXPERT_RE.fullmatch(gguf_name)
            if match:
                layer, part, expert = match.groups()
                return self._expert_name(gguf_name, layer, part, int(expert))
        match = _BLOCK_RE.fullmatch(gguf_name)
        if match and match.group(2) in block:
            layer, part, suffix = match.groups()
            return f"model.layers.{self._layer(gguf_name, layer)}.{block[part]}.{suffix}"
        match = _TOP_RE.fullmatch(gguf_name)
        if match and match.group(1) in _LLAMA_TOP:
            return f"{_LLAMA_TOP[match.group(1)]}.{match.group(2)}"
        raise AccelError(f"{self.path}: GGUF tensor {gguf_name!r} has no Hugging Face {self.architecture} "
                         f"counterpart")

    def _expert_name(self, gguf_name: str, layer: str, part: str, expert: int) -> str:
        if expert >= self._expert_count:
            raise FormatError(f"{self.path}: tensor {gguf_name} is expert {expert} of {self._expert_count}")
        moe = self._moe
        return f"model.layers.{self._layer(gguf_name, layer)}.{moe.experts}.{expert}.{moe.projections[part]}.weight"

    def _stacked_entries(self, gguf_name: str, t: Any) -> dict[str, _Entry]:
        """One entry an expert for a stacked experts tensor ([experts, rows, columns] in PyTorch's order)."""
        layer, part = _STACKED_RE.fullmatch(gguf_name).groups()
        shape = tuple(reversed(t.shape))
        if len(shape) != 3 or shape[0] != self._expert_count:
            raise FormatError(f"{self.path}: tensor {gguf_name} is {list(shape)}, not "
                              f"[{self._expert_count} experts, rows, columns]")
        dtype = _FLOAT_TYPES.get(t.tensor_type.name, "float32")
        return {self._expert_name(gguf_name, layer, part, e): _Entry(gguf_name, shape[1:], dtype, None, e)
                for e in range(shape[0])}

    def _llama_entries(self) -> dict[str, _Entry]:
        cfg = self.config
        entries: dict[str, _Entry] = {}
        for gguf_name, t in self._tensors.items():
            if gguf_name == ROPE_FREQS:  # part of the config (rope_scaling), not a model tensor
                continue
            if self._moe is not None and _STACKED_RE.fullmatch(gguf_name):
                entries.update(self._stacked_entries(gguf_name, t))
                continue
            hf_name = self._hf_name(gguf_name)
            shape = tuple(reversed(t.shape))
            if gguf_name.endswith(".ffn_gate_inp_shexp.weight") and len(shape) == 1:
                shape = (1, shape[0])  # llama.cpp keeps Qwen2-MoE's shared-expert gate as a vector
            qk_heads = None
            if ".attn_q." in gguf_name:
                qk_heads = cfg["num_attention_heads"]
            elif ".attn_k." in gguf_name:
                qk_heads = cfg["num_key_value_heads"]
            if qk_heads is not None and shape[0] != qk_heads * cfg["head_dim"]:
                raise FormatError(
                    f"{self.path}: tensor {gguf_name} has {shape[0]} rows, expected {qk_heads} heads x "
                    f"{cfg['head_dim']}"
                )
            if self.architecture != "llama":  # only llama's Q/K rows are permuted by llama.cpp
                qk_heads = None
            type_name = t.tensor_type.name
            entries[hf_name] = _Entry(gguf_name, shape, _FLOAT_TYPES.get(type_name, "float32"), qk_heads)
        return entries

    # --- ModelSource ---------------------------------------------------------------------------------------

    def tensor_names(self) -> list[str]:
        return list(self._names)

    def gguf_name(self, name: str) -> str:
        """The name the GGUF file stores a Hugging Face tensor under."""
        if name not in self._entries:
            raise self._unknown_tensor(name)
        return self._entries[name].gguf_name

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        if name not in self._entries:
            raise self._unknown_tensor(name)
        return self._entries[name].shape

    def tensor_dtype(self, name: str) -> str:
        if name not in self._entries:
            raise self._unknown_tensor(name)
        return self._entries[name].dtype

    def _data(self, gguf_name: str, expert: int | None = None) -> np.ndarray:
        """A stored tensor's mapped data, or one expert's slice of a stacked experts tensor."""
        data = self._tensors[gguf_name].data
        return data if expert is None else data[expert]

    def _dequantized(self, gguf_name: str, expert: int | None = None) -> np.ndarray:
        """A stored tensor (or one expert of it) as float32 (flat, GGUF order), a damaged block a FormatError
        naming it."""
        import gguf

        t = self._tensors[gguf_name]
        data = self._data(gguf_name, expert)
        try:
            if data.dtype != np.uint8 or data.ndim < 2:  # float types, and 1-D quantized tensors: whole
                return np.asarray(gguf.quants.dequantize(data, t.tensor_type), dtype=np.float32).reshape(-1)
            # quantized rows (whole blocks each) a slice at a time: gguf's dequantization of a whole tensor peaks at
            # twice its float32 size, the result and as much again in temporaries (217 MiB for SmolLM2's 108 MiB
            # embedding table)
            rows = data.reshape(-1, data.shape[-1])
            block_size, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
            width = data.shape[-1] // type_size * block_size
            out = np.empty((len(rows), width), dtype=np.float32)
            for r in row_passes(len(rows), width, DEQUANTIZE_ELEMENTS):
                out[r] = np.asarray(gguf.quants.dequantize(rows[r], t.tensor_type), dtype=np.float32).reshape(-1, width)
            return out.reshape(-1)
        except Exception as err:
            raise FormatError(f"{self.path}: cannot dequantize {gguf_name} ({t.tensor_type.name}): "
                              f"{one_line(err)}") from err

    def load_tensor(self, name: str) -> np.ndarray:
        entry = self._entries.get(name)
        if entry is None:
            raise self._unknown_tensor(name)
        values = self._dequantized(entry.gguf_name, entry.expert).reshape(entry.shape)
        if entry.qk_heads is not None:
            values = unpermute_qk(values, entry.qk_heads)
        # A fresh array either way: F32 tensors come back as views of the read-only memory map (not writeable) and
        # are copied; the dequantized types are new arrays already, and a second copy of them only raised the peak
        # (an 8B model's float32 embedding table is 2 GiB)
        if not (values.flags.writeable and values.flags.c_contiguous and values.dtype == np.float32):
            values = np.array(values, dtype=np.float32, order="C", copy=True)
        self._release(entry)
        return values

    def _release(self, entry: _Entry) -> None:
        """Drop a tensor's mapped pages (an expert's, of a stacked tensor) from this process's resident set once it
        is copied out (they fault back in from the page cache if read again): a whole file's worth otherwise
        stayed resident and counted in quantize's peak_rss_mb (docs/architecture.md, "Memory")."""
        t = self._tensors[entry.gguf_name]
        size = t.n_bytes if entry.expert is None else t.n_bytes // int(t.data.shape[0])
        start = t.data_offset + (entry.expert or 0) * size
        drop_resident(self._header.mapping, start, start + size)

    def native_grid(self, name: str) -> dict[str, Any] | None:
        """Q4_1 blocks (x = d*q + m, q in 0..15) and Q8_0 blocks (x = d*q, q in -128..127; as q + 128 on the grid
        with offset -128 d, exact in float32 since d has 11 significant bits) of 32 along a row, for 2-D tensors
        stored unpermuted; gguf's dequantization computes the same float32 operations as the affine codec's."""
        entry = self._entries.get(name)
        if entry is None:
            raise self._unknown_tensor(name)
        t = self._tensors[entry.gguf_name]
        kind = t.tensor_type.name
        if kind not in ("Q4_1", "Q8_0") or entry.qk_heads is not None or len(entry.shape) != 2 or entry.shape[1] % 32:
            return None
        rows, groups = entry.shape[0], entry.shape[1] // 32
        blocks = np.asarray(self._data(entry.gguf_name, entry.expert), dtype=np.uint8).reshape(rows * groups, -1)
        d = blocks[:, 0:2].copy().view(np.float16).reshape(rows, groups)
        if kind == "Q4_1":
            offset = blocks[:, 2:4].copy().view(np.float16).reshape(rows, groups)
            self._release(entry)
            return {"levels": 16, "group": 32, "scale": d, "offset": offset}
        self._release(entry)
        with np.errstate(over="ignore"):
            offset = (d.astype(np.float32) * -128).astype(np.float16)
        return {"levels": 256, "group": 32, "scale": d, "offset": offset}

    def load_tokenizer(self) -> Any:
        if self._tokenizer is None:
            if not self._has_tokenizer:
                raise AccelError(f"{self.path}: the GGUF file carries no tokenizer")
            from accel.converters.tokenizer_cache import cached_tokenizer

            try:
                self._tokenizer = cached_tokenizer(self._tokenizer_key, self._vocab, self._build_tokenizer)
            except Exception as err:
                raise AccelError(f"{self.path}: cannot build the tokenizer: {one_line(err)}") from err
        return self._tokenizer

    def tokenizer_work(self) -> str | None:
        from accel.converters.tokenizer_cache import cache_dir, is_cached

        if self._tokenizer is not None or not self._has_tokenizer:
            return None
        try:
            if is_cached(self._tokenizer_key):
                return None
        except OSError:
            return None  # load_tokenizer says what is wrong with the file
        return "converting the GGUF tokenizer" + (" (once: cached)" if cache_dir() is not None else "")

    @functools.cached_property
    def _tokenizer_key(self) -> str:
        """The tokenizer cache's key: the header and metadata bytes (what the conversion reads), hashed."""
        from accel.converters.tokenizer_cache import cache_key

        with open(self.path, "rb") as f:
            return cache_key(f.read(self._metadata_end))

    def _build_tokenizer(self) -> Any:
        """transformers' conversion of the file's tokenizer metadata (seconds: accel caches the result)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)

    def save_support_files(self, out_dir: Path) -> None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_bytes(config_json_bytes(self.config))
        try:
            tokenizer = self.load_tokenizer()
        except AccelError:  # a file without a tokenizer quantizes as a directory without one does (a warning)
            return
        tokenizer.save_pretrained(str(out_dir))

    def close(self) -> None:
        self._tensors = {}
        self._header = None
