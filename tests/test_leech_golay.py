"""The extended Golay code: weights, linearity, distance and the codeword <-> index maps."""

import numpy as np
import pytest

from accel.quantize.leech import (
    codeword_to_index,
    codeword_weights,
    codewords,
    codewords_of_weight,
    generator_matrix,
    index_to_codeword,
    is_codeword,
    rank_in_weight,
)


def test_golay_weight_distribution_is_1_759_2576_759_1():
    weights, counts = np.unique(codewords().sum(axis=1), return_counts=True)
    assert weights.tolist() == [0, 8, 12, 16, 24]
    assert counts.tolist() == [1, 759, 2576, 759, 1]
    assert np.array_equal(codeword_weights(), codewords().sum(axis=1))


def test_golay_codewords_are_distinct_binary_and_deterministic():
    words = codewords()
    assert words.shape == (4096, 24) and words.dtype == np.uint8
    assert set(np.unique(words).tolist()) == {0, 1}
    assert np.unique(words, axis=0).shape[0] == 4096
    assert not words.flags.writeable
    assert np.array_equal(words[0], np.zeros(24))  # index 0 is the zero codeword


def test_golay_generator_is_systematic():
    g = generator_matrix()
    assert g.shape == (12, 24)
    assert np.array_equal(g[:, :12], np.eye(12, dtype=np.uint8))
    # row i of the codeword table is the message of i's bits, MSB first
    assert np.array_equal(codewords()[1 << 11], g[0])
    assert np.array_equal(codewords()[1], g[11])


def test_golay_closed_under_addition():
    words = codewords()
    rng = np.random.default_rng(0)
    i, j = rng.integers(0, 4096, (2, 5000))
    assert is_codeword(words[i] ^ words[j]).all()
    # and every sum of a codeword with a generator row stays in the code (the whole code, exhaustively)
    for row in generator_matrix():
        assert is_codeword(words ^ row).all()


def test_golay_minimum_distance_is_8():
    words = codewords().astype(np.int64)
    # linear code: the minimum distance is the least nonzero weight; check pairwise too, on a sample
    assert words[1:].sum(axis=1).min() == 8
    sample = words[np.random.default_rng(1).choice(4096, 300, replace=False)]
    dist = (sample[:, None, :] != sample[None, :, :]).sum(axis=2)
    assert dist[~np.eye(300, dtype=bool)].min() >= 8


def test_codeword_index_maps_are_inverse():
    idx = np.arange(4096)
    assert np.array_equal(codeword_to_index(codewords()), idx)
    assert np.array_equal(index_to_codeword(idx), codewords())


def test_codewords_of_weight_and_rank_in_weight_agree():
    ranks = rank_in_weight()
    for w, count in zip((0, 8, 12, 16, 24), (1, 759, 2576, 759, 1)):
        idx = codewords_of_weight(w)
        assert idx.size == count
        assert (codeword_weights()[idx] == w).all()
        assert np.array_equal(ranks[idx], np.arange(count))
        assert np.all(np.diff(idx) > 0)


def test_codeword_to_index_rejects_non_codewords():
    word = codewords()[5].copy()
    word[20] ^= 1
    with pytest.raises(ValueError, match="not a codeword"):
        codeword_to_index(word[None, :])
    with pytest.raises(ValueError, match="shape"):
        codeword_to_index(np.zeros((3, 23), dtype=np.uint8))
    with pytest.raises(ValueError, match="0 or 1"):
        codeword_to_index(np.full((1, 24), 2))
    with pytest.raises(ValueError, match="weight"):
        codewords_of_weight(4)
    with pytest.raises(ValueError, match="4096"):
        index_to_codeword(np.array([4096]))
