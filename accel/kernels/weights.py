"""Kernel-side views of stored weights: the parts of one logical tensor, checked, with the C kernels bound to them.

A `KernelWeight` never builds the dense matrix. `matvec` runs the fused decode + matrix-vector kernel; `decode_rows`
decodes a tile of rows (the batched path of QuantLinear multiplies tiles, one at a time).

Supported: the `affine` codec in the `packed` layout (any width 1..8; fast paths for 8, 4 and 2 bits) and the
`base` layout (base-L groups), and the `leech` codec in its serving layouts `planes` and `onehot` (the `compact`
index stream is converted to planes once, at load: index -> point arithmetic, no dense matrix).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cached_property
from typing import Any

import numpy as np

from accel.errors import AccelError, FormatError
from accel.formats import bitpack
from accel.formats.codecs import get_codec
from accel.formats.tensor import TensorEntry
from accel.kernels._build import library

_THREADS = [0]  # 0: OpenMP's default (OMP_NUM_THREADS, else every core)


def set_threads(n: int) -> None:
    """Threads the CPU kernels use (0 = OpenMP's default)."""
    _THREADS[0] = max(0, int(n))


class Unsupported(AccelError):
    """This codec/layout has no kernel (the caller decodes it densely instead)."""


def ptr(a: Any) -> int:
    """Address of a contiguous numpy array or torch tensor."""
    if isinstance(a, np.ndarray):
        if not a.flags.c_contiguous:
            raise ValueError("kernel arrays must be C-contiguous")
        if a.flags.writeable and a.nbytes:  # 0.3 us, where `a.ctypes.data` takes 1 us (two calls a matvec)
            return ctypes.addressof(ctypes.c_char.from_buffer(a))
        return a.ctypes.data
    if not a.is_contiguous():
        raise ValueError("kernel tensors must be contiguous")
    return a.data_ptr()


def _check(code: int, what: str) -> None:
    if code != 0:
        raise AccelError(f"kernel {what} refused its arguments (code {code})")


class KernelWeight:
    """Base: a 2-D weight of `shape` (out_features, in_features) whose stored parts a kernel reads."""

    kind: str
    shape: tuple[int, int]
    nbytes: int  # bytes of the parts the kernel reads (Leech: of the serving layout a compact stream becomes)
    call_bytes: int  # what one matvec reads of the weight: nbytes, plus what is derived at load and read on every
    # call (the Leech transforms' signs and odd-factor rotations)
    inner: int  # width of a decoded row tile (in_features, or the padded transformed width for leech)

    def matvec(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        out = np.empty(self.shape[0], dtype=np.float32) if out is None else out
        x = np.ascontiguousarray(x, dtype=np.float32)
        if (x.shape != (self.shape[1],) or not isinstance(out, np.ndarray) or out.shape != (self.shape[0],)
                or out.dtype != np.float32 or not out.flags.writeable):
            raise ValueError(f"matvec of a {self.shape} weight takes x ({self.shape[1]},) and a writable float32 "
                             f"out ({self.shape[0]},)")
        self.matvec_ptr(ptr(x), ptr(out))
        return out

    def matvec_ptr(self, x: int, out: int) -> None:
        raise NotImplementedError

    def decode_rows_ptr(self, r0: int, r1: int, out: int) -> None:
        raise NotImplementedError

    def decode_rows(self, r0: int, r1: int) -> np.ndarray:
        out = np.empty((r1 - r0, self.inner), dtype=np.float32)
        self.decode_rows_ptr(r0, r1, ptr(out))
        return out


_BASE3_WEIGHTS = np.array([1, 3, 9, 27, 81], dtype=np.uint8)  # digit j of a base-3 tile byte weighs 3^j


class AffineWeight(KernelWeight):
    """`affine` codes in the `packed` (bit stream) or `base` (base-L groups) layout, scales (and offsets) per group."""

    def __init__(self, entry: TensorEntry, parts: dict[str, np.ndarray], check: bool = True):
        if len(entry.shape) != 2:
            raise Unsupported(f"tensor '{entry.name}': kernels take 2-D weights, not {list(entry.shape)}")
        p = entry.params
        self.levels, self.group, self.symmetric = int(p["levels"]), int(p["group"]), bool(p["symmetric"])
        self.scale_f32 = p["scale_dtype"] == "float32"
        self.layout = entry.layout
        if entry.layout in ("packed", "compact"):
            self.bits = bitpack.bits_for_levels(self.levels)
            self.base_g, self.base_b = 0, 0
            self.kind = f"affine-packed{self.bits}"
        elif entry.layout == "base":
            self.bits = bitpack.bits_for_levels(self.levels)
            self.base_g, self.base_b = bitpack.base_grouping(self.levels)
            self.kind = f"affine-base{self.levels}"
        else:
            raise Unsupported(f"tensor '{entry.name}': no kernel for affine codes in the '{entry.layout}' layout")
        self.shape = (int(entry.shape[0]), int(entry.shape[1]))
        self.inner = self.shape[1]
        self.codes = np.ascontiguousarray(parts["codes"]).reshape(-1)
        self.scale = np.ascontiguousarray(parts["scale"])
        self.offset = None if self.symmetric else np.ascontiguousarray(parts["offset"])
        self.nbytes = self.call_bytes = int(sum(np.asarray(a).nbytes for a in parts.values()))
        self._lib = library()
        # a 16-row tile copy for the integer kernels (csrc/affine_tiles.c), where the CPU and the shapes allow; it
        # replaces the stored stream in memory. "packed": 8/4/2-bit codes; "base3": L = 3, in the base-3 tiles' order.
        # accel_tiled_kinds: bit b for b-bit packed codes, bit 3 for base-3 (AVX-512 VNNI: all; AVX2 too)
        self.tiled = None
        kinds = self._lib.accel_tiled_kinds()
        if self._tileable() and kinds & (1 << self.bits):
            self.tiled = "packed"
        elif (self.layout == "base" and self.levels == 3 and self.shape[0] > 0 and self.shape[1] > 0
              and kinds & (1 << 3)):
            self.tiled = "base3"
        # with L below 2^bits a stored code can be past L: refuse it as every reader does (the base-3 copy unpacks
        # the stream, which checks it)
        if check and self.levels < 1 << self.bits and self.tiled != "base3":
            layout = get_codec("affine").layout_for(entry.layout, "codes", p)
            _check_codes(entry, lambda: layout.unpack(self.codes, self.levels, entry.numel))
        if self.tiled:
            _check_codes(entry, self._make_tiles)

    def _tileable(self) -> bool:
        """8-, 4- or 2-bit packed codes whose groups are whole 4-byte steps of a row (or one group a row)."""
        if self.layout != "packed" or self.bits not in (8, 4, 2):
            return False
        per = 8 // self.bits
        rows, cols = self.shape
        ngroups = -(-cols // self.group)
        return (rows > 0 and cols % per == 0 and (ngroups == 1 or self.group % (4 * per) == 0)
                and self.codes.size == rows * cols // per)

    def _row_bytes(self) -> np.ndarray:
        """(rows, bytes) of each row's codes in the order of its tile steps: as stored for packed codes; base-3 codes 5
        to a byte (digit j weighs 3^j, as in the format), digit j of a super-block's bytes holding its block j, 4
        columns a step (csrc/base3_tiles.c)."""
        rows, cols = self.shape
        if self.tiled == "packed":
            return self.codes.reshape(rows, cols * self.bits // 8)
        g = self._base3_geometry()
        digits = np.zeros((rows, g["digits"]), dtype=np.uint8)
        digits[:, :cols] = bitpack.unpack_base_levels(self.codes, 3, rows * cols).reshape(rows, cols)
        blocks = np.zeros((rows, g["supers"], 5, 4 * g["steps"]), dtype=np.uint8)
        blocks[..., : g["width"]] = digits.reshape(rows, g["supers"], 5, g["width"])
        return (blocks * _BASE3_WEIGHTS[:, None]).sum(axis=2, dtype=np.uint8).reshape(rows, -1)

    def _base3_geometry(self) -> dict[str, int]:
        """How the base-3 tile copy places a row's codes: input blocks of `width` columns (the kernels' choice), 5 of
        them a super-block of `steps` 4-byte steps, `supers` of those a row, holding `digits` codes and zero padding."""
        cols = self.shape[1]
        width = int(self._lib.accel_base3_block_width(cols, self.group))
        supers = -(-cols // (5 * width))  # = ceil(ceil(cols / width) / 5)
        return {"width": width, "steps": -(-width // 4), "supers": supers, "digits": supers * 5 * width}

    def _make_tiles(self) -> None:
        """The 16-row tile copy [tile][step][row][4 bytes] the integer kernels read; it replaces the code stream."""
        rows, cols = self.shape
        row_bytes = self._row_bytes()
        nbr, ngroups, ntiles = row_bytes.shape[1], -(-cols // self.group), -(-rows // 16)
        steps = -(-nbr // 4)
        tiles = np.zeros((ntiles * 16, steps * 4), dtype=np.uint8)
        tiles[:rows, :nbr] = row_bytes
        self.codes = np.ascontiguousarray(tiles.reshape(ntiles, 16, steps, 4).transpose(0, 2, 1, 3))

        def by_tile(side: np.ndarray) -> np.ndarray:
            padded = np.zeros((ntiles * 16, ngroups), dtype=side.dtype)
            padded[:rows] = side.reshape(rows, ngroups)
            return np.ascontiguousarray(padded.reshape(ntiles, 16, ngroups).transpose(0, 2, 1))

        self.scale = by_tile(self.scale)
        self.offset = None if self.offset is None else by_tile(self.offset)

    def stored(self) -> dict[str, np.ndarray]:
        """The parts in their stored layout (`codes` flat, `scale`, `offset` [rows, groups]), for readers other than
        the CPU kernels (the Triton path): the tile copy inverted when it replaced them, bit-exact."""
        rows, cols = self.shape
        ngroups = -(-cols // self.group)
        if not self.tiled:
            sides = {"scale": self.scale, "offset": self.offset}
            return {"codes": self.codes, **{k: v for k, v in sides.items() if v is not None}}
        ntiles = -(-rows // 16)
        steps = self.codes.size // (ntiles * 64)
        by_row = self.codes.reshape(ntiles, steps, 16, 4).transpose(0, 2, 1, 3).reshape(ntiles * 16, steps * 4)[:rows]
        if self.tiled == "packed":
            codes = np.ascontiguousarray(by_row[:, : cols * self.bits // 8]).reshape(-1)
        else:  # base3: the digits back in column order (_row_bytes inverted), then the format's stream
            g = self._base3_geometry()
            planes = (by_row.reshape(rows, g["supers"], 1, -1) // _BASE3_WEIGHTS[:, None]) % 3
            digits = planes[..., : g["width"]].reshape(rows, -1)
            codes = bitpack.pack_base_levels(np.ascontiguousarray(digits[:, :cols]).reshape(-1), 3)

        def by_rows(side: np.ndarray) -> np.ndarray:
            return np.ascontiguousarray(side.transpose(0, 2, 1).reshape(ntiles * 16, ngroups)[:rows])

        out = {"codes": codes, "scale": by_rows(self.scale)}
        if self.offset is not None:
            out["offset"] = by_rows(self.offset)
        return out

    def _tiled_args(self) -> tuple:
        sides = (int(self.symmetric), int(self.scale_f32), ptr(self.scale),
                 None if self.offset is None else ptr(self.offset), self.shape[0], self.shape[1], self.group)
        if self.tiled == "base3":
            return (ptr(self.codes), *sides)
        return (ptr(self.codes), self.bits, self.levels, *sides)

    def _common(self) -> tuple:
        return (ptr(self.codes), self.codes.size, self.bits, self.levels, self.base_g, self.base_b,
                int(self.symmetric), int(self.scale_f32), ptr(self.scale),
                None if self.offset is None else ptr(self.offset), self.shape[0], self.shape[1], self.group)

    @cached_property
    def _kernels(self) -> tuple:
        """(matvec, decode_rows, the leading arguments both take), fixed once the weight is built: a decode step
        calls matvec for every linear, so the addresses are not looked up again on each call (the arrays a
        KernelWeight holds are never replaced after construction; these addresses point into them)."""
        if self.tiled == "base3":
            return self._lib.accel_base3_tiled_matvec, self._lib.accel_base3_tiled_decode_rows, self._tiled_args()
        if self.tiled:
            return self._lib.accel_affine_tiled_matvec, self._lib.accel_affine_tiled_decode_rows, self._tiled_args()
        return self._lib.accel_affine_matvec, self._lib.accel_affine_decode_rows, self._common()

    def matvec_ptr(self, x, out):
        matvec, _, args = self._kernels
        _check(matvec(*args, x, out, _THREADS[0]), matvec.__name__)

    def decode_rows_ptr(self, r0, r1, out):
        _, decode_rows, args = self._kernels
        _check(decode_rows(*args, r0, r1, out, _THREADS[0]), decode_rows.__name__)


class LeechWeight(KernelWeight):
    """`leech` code streams in the `planes` or `onehot` serving layout (compact streams converted to planes)."""

    def __init__(self, entry: TensorEntry, parts: dict[str, np.ndarray], check: bool = True):
        from accel.formats.leech_codec import (
            STREAM_NAMES,
            LeechOneHotLayout,
            LeechPlanesLayout,
            _plane_bits,
        )
        from accel.quantize.incoherence import _factors, split_size

        p = entry.params
        codec = get_codec("leech")
        self.shape = (int(entry.shape[0]), int(entry.shape[1]))
        self.cols = int(p["cols"])
        self.inner = self.cols
        layout = "planes" if entry.layout in ("packed", "compact") else entry.layout
        if layout not in ("planes", "onehot"):
            raise Unsupported(f"tensor '{entry.name}': no kernel for leech codes in the '{entry.layout}' layout")
        self.kind = f"leech-{layout}"
        streams, kinds, params, alphas = [], [], [], []
        for name, stage in zip(STREAM_NAMES, p["stages"], strict=False):
            stored = np.ascontiguousarray(parts[name]).reshape(-1)
            levels, count = codec.streams(p, entry.shape)[name]
            served = codec.layout_for(entry.layout, name, p)
            if entry.layout in ("packed", "compact"):  # index stream -> coordinates, once (unpack checks it)
                indices = _check_codes(entry, lambda: served.unpack(stored, levels, count))  # noqa: B023
                stored = LeechPlanesLayout(stage["max_shell"]).pack(indices, levels)
            elif check:  # the points as stored: refuse any outside the ball, as every other reader does
                _check_codes(entry, lambda: served.check(stored, levels, count))  # noqa: B023
            streams.append(stored)
            kinds.append(0 if layout == "planes" else 1)
            params.append(_plane_bits(stage["max_shell"]) if layout == "planes"
                          else LeechOneHotLayout(stage["max_shell"])._levels())
            alphas.append(float(stage["alpha"]))
        self.streams = streams
        self._lib = library()
        # 4-plane and onehot stages also get a 16-row tile copy of their bit planes, read with plain loads instead
        # of gathers, followed by a tile copy of their parity bits (csrc/leech_tiles.c, leech_rows.c); the stored streams stay for
        # decode_rows and the float path
        tiles_ok = bool(self._lib.accel_leech_tiles_available())
        lane_order = bool(self._lib.accel_leech_planes_lane_order())
        tiled = [_leech_tile_copy(s, kind, n, self.shape[0], self.cols, lane_order) if tiles_ok else None
                 for s, kind, n in zip(streams, kinds, params, strict=True)]
        self.tiled = [t for t in tiled if t is not None]
        self._tiled_ptrs = (ctypes.c_void_p * len(tiled))(*[None if t is None else t.ctypes.data for t in tiled])
        self.scale = np.ascontiguousarray(parts["scale"]).view(np.uint16)
        self.nbytes = int(sum(s.nbytes for s in streams) + self.scale.nbytes)
        n = len(streams)
        self._stream_ptrs = (ctypes.c_void_p * n)(*[s.ctypes.data for s in streams])
        self._stream_bytes = (ctypes.c_int64 * n)(*[s.size for s in streams])
        self._kinds = (ctypes.c_int * n)(*kinds)
        self._params = (ctypes.c_int * n)(*params)
        self._alphas = (ctypes.c_float * n)(*alphas)
        self.nstages = n
        # V is only applied forward (to inputs) and U only inverse (to outputs): keep R for V and R^T for U
        self.factors = {}
        for side, size, seed in (("in", self.cols, p["seed_in"]), ("out", self.shape[0], p["seed_out"])):
            signs, rot = _factors(size, int(seed))
            self.factors[side] = (np.ascontiguousarray(signs, dtype=np.float32),
                                  np.ascontiguousarray(rot if side == "in" else rot.T, dtype=np.float32),
                                  split_size(size)[0])
        self.call_bytes = self.nbytes + sum(signs.nbytes + (mat.nbytes if odd > 1 else 0)
                                            for signs, mat, odd in self.factors.values())

    @cached_property
    def _head(self) -> tuple:
        return (self.nstages, self._stream_ptrs, self._stream_bytes, self._kinds, self._params, self._alphas,
                ptr(self.scale), self.shape[0], self.cols)

    @cached_property
    def _matvec_args(self) -> tuple:
        """accel_leech_matvec's arguments before x and out, fixed once the weight is built (see AffineWeight)."""
        (si, ri, mi), (so, ro, mo) = self.factors["in"], self.factors["out"]
        head = self._head
        return (*head[:7], self._tiled_ptrs, *head[7:], self.shape[1], ptr(si), ptr(ri), mi, ptr(so), ptr(ro), mo)

    def matvec_ptr(self, x, out):
        _check(self._lib.accel_leech_matvec(*self._matvec_args, x, out, _THREADS[0]), "accel_leech_matvec")

    def decode_rows_ptr(self, r0, r1, out):
        """Rows of the transformed weight T (scale * sum of stage points), `cols` wide: W = U^T T V."""
        _check(self._lib.accel_leech_decode_rows(*self._head, r0, r1, out, _THREADS[0]), "accel_leech_decode_rows")

    def rht_ptr(self, data: int, nvec: int, side: str) -> None:
        """In place on nvec contiguous vectors: V x (side "in") or U^T t (side "out")."""
        signs, mat, odd = self.factors[side]
        _check(self._lib.accel_rht(data, nvec, signs.size, ptr(signs), ptr(mat), odd, int(side == "out"),
                                   _THREADS[0]), "accel_rht")


_LANE_ROWS = [0, 4, 1, 5, 2, 6, 3, 7]  # the AVX2 order of a half tile's rows: rows 0, 4, 1, 5 | 2, 6, 3, 7


def _planes_tiles(stream: np.ndarray, rows: int, cols: int, lane_order: bool = False) -> np.ndarray:
    """A 4-plane stage's planes as 16-row tiles (see csrc/leech_tiles.c).

    The AVX-512 kernel's order: [tile][step][half][row][qword], byte 7 - (4 a + j) of a row's qword = plane j's byte
    2 step + a of that row. The AVX2 kernel's (lane_order): [tile][step][half][a][row in _LANE_ROWS][dword], byte
    3 - j of a dword = plane j's byte 2 step + a, with the top plane complemented (leech_lut_step)."""
    rowbytes = cols // 8
    steps, ntiles = -(-rowbytes // 2), -(-rows // 16)
    planes = np.zeros((4, ntiles * 16, 2 * steps), dtype=np.uint8)
    planes[:, :rows, :rowbytes] = stream[: 4 * rows * rowbytes].reshape(4, rows, rowbytes)
    q = planes.reshape(4, ntiles, 2, 8, steps, 2).transpose(1, 4, 2, 5, 3, 0)  # tile, step, half, a, row, plane
    if not lane_order:  # row, then a and plane both reversed: byte 7 - (4 a + j)
        return np.ascontiguousarray(q.transpose(0, 1, 2, 4, 3, 5)[..., ::-1, ::-1]).reshape(-1)
    q = q[:, :, :, :, _LANE_ROWS, ::-1].copy()
    q[..., 0] ^= 0xFF  # plane 3
    return q.reshape(-1)


def _onehot_tiles(stream: np.ndarray, rows: int, cols: int, planes: int) -> np.ndarray:
    """A onehot stage's masks and sign plane as 16-row tiles: [tile][dword][plane][row][4 bytes]."""
    rowbytes = cols // 8
    steps, ntiles = -(-rowbytes // 4), -(-rows // 16)
    p = np.zeros((planes, ntiles * 16, 4 * steps), dtype=np.uint8)
    p[:, :rows, :rowbytes] = stream[: planes * rows * rowbytes].reshape(planes, rows, rowbytes)
    return np.ascontiguousarray(p.reshape(planes, ntiles, 16, steps, 4).transpose(1, 3, 0, 2, 4)).reshape(-1)


def _leech_tile_copy(stream: np.ndarray, kind: int, n: int, rows: int, cols: int,
                     lane_order: bool = False) -> np.ndarray | None:
    """The tile copy a Leech stage's kernel reads (4-plane stages: kind 0, n = 4 planes; onehot: kind 1, n = K
    masks), its planes' tiles then its parity words; None for stages the gathered kernel reads as stored.
    lane_order: the AVX2 build's order of the 4-plane tiles (accel_leech_planes_lane_order)."""
    if kind == 0 and n != 4:
        return None
    planes = (_planes_tiles(stream, rows, cols, lane_order) if kind == 0
              else _onehot_tiles(stream, rows, cols, n + 1))
    parity = stream[(n + kind) * 3 * rows * (cols // 24):]  # after the n planes (and the onehot sign plane)
    return np.concatenate([planes, _parity_tiles(parity, rows, cols // 24)])


def _parity_tiles(parity: np.ndarray, rows: int, nblk: int) -> np.ndarray:
    """A stage's parity bits (one per row and 24-column block, LSB first) as 16-row tiles: [tile][word][row] uint32,
    word k holding blocks 32 k .. 32 k + 31 of the row (zero past the row and past the last row)."""
    words, ntiles = -(-nblk // 32), -(-rows // 16)
    bits = np.zeros((ntiles * 16, words * 32), dtype=np.uint8)
    bits[:rows, :nblk] = np.unpackbits(parity[: -(-rows * nblk // 8)], bitorder="little")[: rows * nblk].reshape(
        rows, nblk)
    packed = np.packbits(bits, axis=1, bitorder="little").view("<u4")  # [row][word]
    return np.ascontiguousarray(packed.reshape(ntiles, 16, words).transpose(0, 2, 1)).view(np.uint8).reshape(-1)


def _check_codes(entry: TensorEntry, check: Callable[[], Any]) -> Any:
    """Run a layout's unpack or check of the stored codes: the kernels read them as they are, so a code the format
    refuses (past L, a vector outside the Leech ball) is refused here too, naming the tensor."""
    try:
        return check()
    except FormatError as exc:
        raise FormatError(f"tensor '{entry.name}': {exc}") from None


def kernel_weight(entry: TensorEntry, parts: dict[str, np.ndarray], check: bool = True) -> KernelWeight:
    """The kernel view of one logical tensor's stored parts (keyed by part name); Unsupported if none fits. The codes
    are checked as the format's readers check them (FormatError), unless `check` is false: tests that feed the
    kernels bit patterns no writer makes."""
    if entry.codec == "affine":
        return AffineWeight(entry, parts, check)
    if entry.codec == "leech":
        return LeechWeight(entry, parts, check)
    raise Unsupported(f"tensor '{entry.name}': no kernel for the '{entry.codec}' codec")
