"""Model sources in (HF safetensors directories, GGUF files, built-in aliases) and their materialization."""

from accel.converters.aliases import ALIASES, alias_table, resolve_alias
from accel.converters.gguf_file import GGUFSource
from accel.converters.hf_dir import HFDirSource
from accel.converters.materialize import build_transformers_model
from accel.converters.sources import ModelSource, announce_tokenizer_work, open_model

__all__ = [
    "ALIASES",
    "GGUFSource",
    "HFDirSource",
    "ModelSource",
    "alias_table",
    "announce_tokenizer_work",
    "build_transformers_model",
    "open_model",
    "resolve_alias",
]
