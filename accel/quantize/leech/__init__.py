"""Leech-lattice core: Golay code, lattice membership, shell classes, ball indexing and nearest-point search."""

from accel.quantize.leech.golay import (
    LeechArgumentError,
    codeword_to_index,
    codeword_weights,
    codewords,
    codewords_of_weight,
    generator_matrix,
    index_to_codeword,
    is_codeword,
    rank_in_weight,
)
from accel.quantize.leech.index import (
    ball_index_size,
    class_offsets,
    index_to_point,
    point_to_index,
)
from accel.quantize.leech.lattice import NORM_PER_SHELL, is_leech_point, shell_of, squared_norm
from accel.quantize.leech.search import SearchResult, nearest_direction, nearest_point
from accel.quantize.leech.shells import (
    MAX_SHELL,
    MIN_SHELL,
    LeechClass,
    ball_size,
    class_table,
    shell_classes,
    shell_size,
)

__all__ = [
    "MAX_SHELL",
    "MIN_SHELL",
    "NORM_PER_SHELL",
    "LeechArgumentError",
    "LeechClass",
    "SearchResult",
    "ball_index_size",
    "ball_size",
    "class_offsets",
    "class_table",
    "codeword_to_index",
    "codeword_weights",
    "codewords",
    "codewords_of_weight",
    "generator_matrix",
    "index_to_codeword",
    "index_to_point",
    "is_codeword",
    "is_leech_point",
    "nearest_direction",
    "nearest_point",
    "point_to_index",
    "rank_in_weight",
    "shell_classes",
    "shell_of",
    "shell_size",
    "squared_norm",
]
