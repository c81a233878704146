"""The common format library: container, codec registry, layouts, bit packing, checksums, atomic IO."""

from accel.formats import leech_codec  # noqa: F401  (registers the leech codec)
from accel.formats.artifact import Artifact, write_weights
from accel.formats.codecs import Codec, get_codec
from accel.formats.container import FORMAT_VERSION, AccelFile, write_file
from accel.formats.layouts import Layout, convert_layout, get_layout
from accel.formats.tensor import TensorEntry, decode_parts, encode_tensor

__all__ = ["FORMAT_VERSION", "AccelFile", "Artifact", "Codec", "Layout", "TensorEntry", "convert_layout",
           "decode_parts", "encode_tensor", "get_codec", "get_layout", "write_file", "write_weights"]
