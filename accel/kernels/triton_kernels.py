"""Triton GPU versions of the fused decode + matvec kernels (UNVERIFIED on a GPU: none was available when they were
written; they are checked under Triton's interpreter and compiled for sm_90 ahead of time).

Importing this module never fails: `available()` says whether Triton and a CUDA device are both present, and
`gpu_weight(kernel_weight)` moves a CPU `KernelWeight`'s stored parts to the device and returns an object whose
`matvec(x)` runs the Triton kernels. The affine kernel computes BLOCK_R rows a program, walking the columns in
BLOCK_C chunks and decoding codes in registers (bytes in, float32 accumulation); the dense matrix is never formed.
A Leech matvec is three kernels or more: the input transform V (`_rht_kernel`), one kernel per stage (4-plane stages
from a nibble copy of their planes, `_leech_nibble_kernel`; 3-plane and one-hot stages from the stored stream,
`_leech_kernel`), and the output transform U^T with the row scales folded in (`_rht_kernel`).
"""

from __future__ import annotations

import os

import numpy as np

try:  # Triton is optional: without it (or without a GPU) nothing here runs and the tests skip
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None


def _device() -> str | None:
    """cuda when a GPU is present; cpu under Triton's interpreter (TRITON_INTERPRET=1), which is how these kernels
    were checked without one; else None."""
    if triton is None:
        return None
    try:
        import torch
    except ImportError:
        return None
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


def available() -> bool:
    return _device() is not None


if triton is not None:

    @triton.jit
    def _affine_kernel(codes, nbytes, scale, offset, x, y, rows, cols, ngroups, group, levels, base_g, base_b,
                       BITS: tl.constexpr, SYMMETRIC: tl.constexpr, BASE: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_C: tl.constexpr):
        pid = tl.program_id(0)
        r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = r < rows
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for c0 in range(0, cols, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            cmask = c < cols
            m = rmask[:, None] & cmask[None, :]
            k = r[:, None].to(tl.int64) * cols + c[None, :]  # code index
            if BASE:  # group value of base_b <= 24 bits (four bytes hold it), digit d = (value // L^d) % L
                grp = k // base_g
                digit = k - grp * base_g
                bit = grp * base_b
                byte = bit >> 3
                word = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.int64)
                for i in tl.static_range(4):
                    word |= tl.load(codes + byte + i, mask=m & (byte + i < nbytes), other=0).to(tl.int64) << (8 * i)
                q = (word >> (bit & 7)) & ((1 << base_b) - 1)
                for d in range(base_g):
                    q = tl.where(digit > d, q // levels, q)
                q = (q % levels).to(tl.float32)
            else:
                bit = k * BITS
                byte = bit >> 3
                lo = tl.load(codes + byte, mask=m, other=0).to(tl.int32)
                hi = tl.load(codes + byte + 1, mask=m & (((bit & 7) + BITS) > 8), other=0).to(tl.int32)
                q = (((lo | (hi << 8)) >> (bit & 7).to(tl.int32)) & ((1 << BITS) - 1)).to(tl.float32)
            g = r[:, None] * ngroups + c[None, :] // group
            s = tl.load(scale + g, mask=m, other=0.0).to(tl.float32)
            if SYMMETRIC:
                w = (q - (levels - 1) * 0.5) * s
            else:
                w = q * s + tl.load(offset + g, mask=m, other=0.0).to(tl.float32)
            xv = tl.load(x + c, mask=cmask, other=0.0)
            acc += tl.sum(tl.where(m, w * xv[None, :], 0.0), axis=1)
        tl.store(y + r, acc, mask=rmask)

    @triton.jit
    def _affine_words_kernel(words, scale, offset, x, y, rows, cols, nwords, ngroups, levels, magic,
                             BITS: tl.constexpr, WPG: tl.constexpr, BLOCK_W: tl.constexpr, SYMMETRIC: tl.constexpr):
        """y[r] = sum_g s_g sum_{c in g} q_c x_c + o_g sum_{c in g} x_c for 8 rows a program, from the GPU copy of
        packed 8-, 4- or 2-bit codes (`affine_words`: 8-row tiles, word k of a row = its codes C k .. C k + C - 1,
        C = 32 / BITS, code n at bits BITS n; WPG words a group), BLOCK_W words an iteration.

        As in `_leech_nibble_kernel`, a code becomes a float by masking it in place and OR-ing it into the mantissa
        of 2^23 (`magic`): 2^23 + q 2^(BITS p) exactly while the field ends below bit 23, so the codes past that
        come from the word shifted right by BITS * R first (R = C - floor(23 / BITS) codes); the input value it
        meets is scaled by 2^-(BITS p). Each word's products are scaled by its group's scale where they are (no
        reduction inside the loop: one sum of the program's [BLOCK_W, 8] accumulator at the end)."""
        C: tl.constexpr = 32 // BITS
        R: tl.constexpr = C - 23 // BITS
        tile = tl.program_id(0)
        rr = tl.arange(0, 8)
        r = tile * 8 + rr
        wbase = words + tile.to(tl.int64) * nwords * 8
        sbase = tile.to(tl.int64) * ngroups * 8
        total = tl.zeros((BLOCK_W, 8), dtype=tl.float32)
        for k0 in range(0, nwords, BLOCK_W):
            k = k0 + tl.arange(0, BLOCK_W)
            kmask = k < nwords
            w = tl.load(wbase + k[:, None] * 8 + rr[None, :], mask=kmask[:, None], other=0)
            high = w >> (BITS * R)
            acc = tl.zeros((BLOCK_W, 8), dtype=tl.float32)
            xsum = tl.zeros((BLOCK_W,), dtype=tl.float32)
            for n in tl.static_range(C):
                c = k * C + n
                xv = tl.load(x + c, mask=c < cols, other=0.0)
                xsum += xv
                if n < C - R:
                    field = w & (((1 << BITS) - 1) << (BITS * n))
                    unscale = 1.0 / (1 << (BITS * n))  # exact: a power of two
                else:
                    field = high & (((1 << BITS) - 1) << (BITS * (n - R)))
                    unscale = 1.0 / (1 << (BITS * (n - R)))
                q = (field | magic).to(tl.float32, bitcast=True) - 8388608.0
                acc += q * (xv * unscale)[:, None]
            sidx = sbase + (k // WPG)[:, None] * 8 + rr[None, :]
            sc = tl.load(scale + sidx, mask=kmask[:, None], other=0.0)
            if SYMMETRIC:
                off = -0.5 * (levels - 1) * sc
            else:
                off = tl.load(offset + sidx, mask=kmask[:, None], other=0.0)
            total += acc * sc + off * xsum[:, None]
        tl.store(y + r, tl.sum(total, axis=0), mask=r < rows)

    @triton.jit
    def _stage_z(zt, c, words, cmask):
        """z[c] from the stage input `zt` (see `_rht_kernel`'s STAGE_INPUT)."""
        n = c & 7
        m = tl.where(n <= 4, n, n - 3)
        unscale = ((127 + 4 * m) << 23).to(tl.float32, bitcast=True)  # 16^m, exactly
        return tl.load(zt + n * words + (c >> 3), mask=cmask, other=0.0) * unscale

    @triton.jit
    def _leech_kernel(stream, zt, t, rows, cols, nblk, plane, alpha, ONEHOT: tl.constexpr, PARAM: tl.constexpr,
                      NPLANES: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_C: tl.constexpr):
        """t[r] (+)= alpha * <x[r], z> for one stage read from its stored planes or one-hot masks (x: the lattice
        point coordinates of row r's blocks)."""
        pid = tl.program_id(0)
        r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = r < rows
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for c0 in range(0, cols, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            cmask = c < cols
            m = rmask[:, None] & cmask[None, :]
            byte = r[:, None].to(tl.int64) * (3 * nblk) + (c[None, :] >> 3)
            sh = (c[None, :] & 7).to(tl.int32)
            blk = r[:, None].to(tl.int64) * nblk + c[None, :] // 24
            par = (tl.load(stream + NPLANES * plane + (blk >> 3), mask=m, other=0).to(tl.int32)
                   >> (blk & 7).to(tl.int32)) & 1
            if ONEHOT:
                mag = par
                for k in tl.static_range(PARAM):
                    bitk = (tl.load(stream + k * plane + byte, mask=m, other=0).to(tl.int32) >> sh) & 1
                    mag += bitk * (2 * (k + 1))
                neg = (tl.load(stream + PARAM * plane + byte, mask=m, other=0).to(tl.int32) >> sh) & 1
                xq = tl.where(neg == 1, -mag, mag)
            else:
                v = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.int32)
                for j in tl.static_range(PARAM):
                    v |= ((tl.load(stream + j * plane + byte, mask=m, other=0).to(tl.int32) >> sh) & 1) << j
                v = tl.where(v >= (1 << (PARAM - 1)), v - (1 << PARAM), v)
                xq = 2 * v + par
            zv = _stage_z(zt, c, cols // 8, cmask)
            acc += tl.sum(tl.where(m, xq.to(tl.float32) * zv[None, :], 0.0), axis=1)
        out = alpha * acc
        if ACCUMULATE:
            out += tl.load(t + r, mask=rmask, other=0.0)
        tl.store(t + r, out, mask=rmask)

    @triton.jit
    def _leech_nibble_kernel(nib, par, zt, t, rows, words, pwords, wsplit, alpha, magic, ACCUMULATE: tl.constexpr,
                             SPLITS: tl.constexpr, BLOCK_W: tl.constexpr, STAGES: tl.constexpr):
        """Partial sums t[split, r] (+)= alpha * <x[r], z> over one split's words, for a 4-plane stage read from its
        GPU copy (`leech_nibbles`: 32-row tiles, word k of a tile = 32 rows' coordinates 8k..8k+7, nibble n of a
        row's word u = v + 8, x = 2v + p).

        Program (tile, split): 32 rows, words split * wsplit up to the next split. The lanes run along the rows,
        so a load of 32 words is one 128-byte line and each input value is one broadcast for 32 rows. A nibble
        becomes a float without a shift or a conversion: masked in place and OR-ed into the mantissa of 2^23, it
        is 2^23 + u * 16^m exactly, and the input row it meets is stored times 16^-m (`_rht_kernel`). `magic` is
        that exponent, 0x4B000000, passed as an argument so that it sits in a register and the mask and the OR are
        one LOP3 (as a literal, ptxas spent a second instruction on them: 5.3 instructions a coordinate, not 4.4).
        Per row: sum x z = 2 sum u z - 16 sum z + sum_b p_b zb_b, with zb_b, block b's input sum, from the word sums."""
        tile = tl.program_id(0)
        split = tl.program_id(1)
        rr = tl.arange(0, 32)
        r = tile * 32 + rr
        k_lo = split * wsplit
        k_hi = tl.minimum(k_lo + wsplit, words)
        base = nib + tile.to(tl.int64) * words * 32
        acc = tl.zeros((BLOCK_W, 32), dtype=tl.float32)
        zsum = tl.zeros((BLOCK_W,), dtype=tl.float32)
        for k0 in tl.range(k_lo, k_hi, BLOCK_W, num_stages=STAGES):
            k = k0 + tl.arange(0, BLOCK_W)
            kmask = k < k_hi
            w = tl.load(base + k[:, None] * 32 + rr[None, :], mask=kmask[:, None], other=0)
            high = w >> 12  # nibbles 5..7 at bits 8..19
            for n in tl.static_range(8):
                if n <= 4:
                    field = w & (15 << (4 * n))
                else:
                    field = high & (15 << (4 * (n - 3)))
                u = (field | magic).to(tl.float32, bitcast=True) - 8388608.0
                acc += u * tl.load(zt + n * words + k, mask=kmask, other=0.0)[:, None]
            zsum += tl.load(zt + 8 * words + k, mask=kmask, other=0.0)
        part = 2.0 * tl.sum(acc, axis=0) - 16.0 * tl.sum(zsum, axis=0)
        pbase = par + tile.to(tl.int64) * pwords * 32
        parity = tl.zeros((32,), dtype=tl.float32)  # apart from `part`: its own layout, joined once at the end
        # the parity words, shared out among the splits (which split starts turns with the tile, so that the
        # programs with one word more are spread over the grid)
        for q in range((split + tile) % SPLITS, pwords, SPLITS):
            pw = tl.load(pbase + q * 32 + rr)
            for b in tl.static_range(32):
                s3 = 3 * (q * 32 + b)
                zb = (tl.load(zt + 8 * words + s3, mask=s3 < words, other=0.0)
                      + tl.load(zt + 8 * words + s3 + 1, mask=s3 + 1 < words, other=0.0)
                      + tl.load(zt + 8 * words + s3 + 2, mask=s3 + 2 < words, other=0.0))
                parity += tl.where(((pw >> b) & 1) != 0, zb, 0.0)
        out = alpha * (part + parity)
        rmask = r < rows
        if ACCUMULATE:
            out += tl.load(t + split * rows + r, mask=rmask, other=0.0)
        tl.store(t + split * rows + r, out, mask=rmask)

    @triton.jit
    def _rht_kernel(src, pre, post, mat, dst, n_src, odd, norm, P: tl.constexpr, LOG2P: tl.constexpr,
                    BI: tl.constexpr, BJ: tl.constexpr, PARTS: tl.constexpr, HAS_POST: tl.constexpr,
                    STAGE_INPUT: tl.constexpr):
        """dst = post * (M ⊗ H_P)(pre * src) on n = odd * P elements (index i * P + p), src read as 0 from n_src on
        and, with PARTS > 1, as the sum of PARTS vectors n_src apart.

        The seeded transforms are this with M = R, pre = signs (forward, V) or M = R^T, post = signs (inverse, U^T;
        pre = the row scales there, folding diag(scale) in). H_P is the normalized Walsh-Hadamard matrix, applied
        in registers as log2(P) butterflies. M mixes the odd axis and H_P the power-of-two one, so the order of
        the two does not matter. A program computes BI values of i for every p.

        STAGE_INPUT writes what the Leech stage kernels read (n / 8 words of 8 values; P is a multiple of 8):
        dst[n' * words + k] = z[8k + n'] * 16^-m, m = n' for n' <= 4 and n' - 3 above, and dst[8 * words + k] the
        word's sum of z."""
        pid = tl.program_id(0)
        i = pid * BI + tl.arange(0, BI)
        imask = i < odd
        p = tl.arange(0, P)
        y = tl.zeros((BI, P), dtype=tl.float32)
        for j0 in range(0, odd, BJ):
            j = j0 + tl.arange(0, BJ)
            c = j[:, None] * P + p[None, :]
            xm = (j[:, None] < odd) & (c < n_src)
            x = tl.load(src + c, mask=xm, other=0.0)
            for part in tl.static_range(1, PARTS):
                x += tl.load(src + part * n_src + c, mask=xm, other=0.0)
            x = x * tl.load(pre + c, mask=xm, other=0.0)
            mij = tl.load(mat + i[:, None] * odd + j[None, :], mask=imask[:, None] & (j[None, :] < odd), other=0.0)
            y += tl.sum(mij[:, :, None] * x[None, :, :], axis=1)
        for s in tl.static_range(LOG2P):  # butterflies of half-width h = 2^s: [a, b] -> [a + b, a - b]
            q = tl.permute(tl.reshape(y, (BI, P >> (s + 1), 2, 1 << s)), (0, 1, 3, 2))
            a, b = tl.split(q)
            y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (BI, P))
        y = y * norm
        c = i[:, None] * P + p[None, :]
        om = imask[:, None] & (p[None, :] < P)
        if HAS_POST:
            y = y * tl.load(post + c, mask=om, other=0.0)
        if STAGE_INPUT:
            words = odd * (P // 8)
            n = c & 7
            m = tl.where(n <= 4, n, n - 3)
            tl.store(dst + n * words + (c >> 3), y * ((127 - 4 * m) << 23).to(tl.float32, bitcast=True), mask=om)
            k = i[:, None] * (P // 8) + tl.arange(0, P // 8)[None, :]
            tl.store(dst + 8 * words + k, tl.sum(tl.reshape(y, (BI, P // 8, 8)), axis=2), mask=imask[:, None])
        else:
            tl.store(dst + c, y, mask=om)


def leech_nibbles(stream: np.ndarray, rows: int, cols: int, chunk: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """A 4-plane Leech stage's GPU copy, in 32-row tiles (the last one padded with zero bits):
    (nibbles [tiles, cols / 8, 32] uint32, parity [tiles, ceil(cols / 768), 32] uint32).

    The same bits as the stored planes, regrouped by coordinate: nibble n of word [tile, k, i] is u = v + 8 for
    coordinate 8k + n of row 32 tile + i (v the 4-bit two's complement of plane bits 0..3, so u is those bits with
    the top one complemented); bit b % 32 of parity word [tile, b // 32, i] is block b's parity bit of that row.
    Pure NumPy, a chunk of rows at a time."""
    rowbytes, nblk = cols // 8, cols // 24
    plane = rows * rowbytes
    tiles = -(-rows // 32)
    planes = stream[: 4 * plane].reshape(4, rows, rowbytes)
    nib = np.zeros((tiles * 32, cols // 2), dtype=np.uint8)
    nib[rows:, :] = 0x88  # padding rows: v = 0
    for r0 in range(0, rows, chunk):
        bits = np.unpackbits(planes[:, r0 : r0 + chunk], axis=2, bitorder="little")
        u = (bits[0] | bits[1] << 1 | bits[2] << 2 | (bits[3] ^ 1) << 3).astype(np.uint8)
        nib[r0 : r0 + u.shape[0]] = u[:, 0::2] | u[:, 1::2] << 4
    flags = np.unpackbits(stream[4 * plane :], count=rows * nblk, bitorder="little").reshape(rows, nblk)
    pwords = -(-nblk // 32)
    padded = np.zeros((tiles * 32, 32 * pwords), dtype=np.uint8)
    padded[:rows, :nblk] = flags
    parity = np.packbits(padded, axis=1, bitorder="little").view("<u4")
    words = nib.view("<u4")
    return (np.ascontiguousarray(words.reshape(tiles, 32, -1).transpose(0, 2, 1)).astype(np.uint32),
            np.ascontiguousarray(parity.reshape(tiles, 32, -1).transpose(0, 2, 1)).astype(np.uint32))


def affine_words(codes: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, bits: int, rows: int, cols: int,
                 group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Packed 8-, 4- or 2-bit affine codes as the GPU's word kernel reads them: (words [tiles, groups * WPG, 8]
    uint32, scale and offset [tiles, groups, 8] float32), 8-row tiles, the last tile and group padded with zeros.

    `codes` is the stored bit stream (code i at bits bits * i, rows one after another); word k of a row holds its
    codes C k .. C k + C - 1 (C = 32 / bits), code n at bits bits * n: the same code bits, regrouped."""
    from accel.formats import bitpack

    per_word = 32 // bits
    ngroups = -(-cols // group)
    tiles = -(-rows // 8)
    q = np.zeros((tiles * 8, ngroups * group), dtype=np.uint32)
    q[:rows, :cols] = bitpack.unpack_bits(codes, bits, rows * cols).reshape(rows, cols)
    fields = q.reshape(tiles * 8, -1, per_word) << (bits * np.arange(per_word, dtype=np.uint32))
    words = np.bitwise_or.reduce(fields, axis=2)

    def tiled(a: np.ndarray, width: int) -> np.ndarray:
        padded = np.zeros((tiles * 8, width), dtype=a.dtype)
        padded[:rows] = a[:rows]
        return np.ascontiguousarray(padded.reshape(tiles, 8, width).transpose(0, 2, 1))

    side = [None if a is None else tiled(a.reshape(rows, ngroups).astype(np.float32), ngroups)
            for a in (scale, offset)]
    return tiled(words, words.shape[1]), side[0], side[1]


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class _Transform:
    """One side's seeded transform on the device: launches `_rht_kernel`, one program per BI values of the odd axis.

    A program's loop over the odd axis takes BJ values a step, its products BI * BJ * P temporaries (at most 8192):
    as few steps as that allows, since each is a round trip to memory (at 4104 columns, odd 513 and P 8: 513
    programs of one step, each reading a row of R)."""

    def __init__(self, signs, mat, odd: int, dev):
        self.n = int(signs.size)
        self.odd = int(odd)
        self.power = self.n // self.odd
        self.signs = dev(signs)
        self.mat = dev(mat)  # odd x odd; for odd = 1 a sign, +-1
        self.log2p = self.power.bit_length() - 1
        budget = 8192
        self.bj = max(1, min(_pow2(self.odd), budget // self.power))
        self.bi = max(1, min(_pow2(self.odd), budget // (self.bj * self.power), 8))
        self.warps = min(16, max(4, self.bi * self.bj * self.power // 512))  # 16 or more temporaries a thread

    def __call__(self, src, n_src: int, dst, pre=None, post=None, stage_input: bool = False, parts: int = 1):
        if stage_input and self.power % 8:
            raise ValueError(f"a stage input needs a power-of-two factor of at least 8, not {self.power}")
        grid = (triton.cdiv(self.odd, self.bi),)
        _rht_kernel[grid](src, self.signs if pre is None else pre, self.signs if post is None else post, self.mat,
                          dst, n_src, self.odd, self.power ** -0.5, P=self.power, LOG2P=self.log2p, BI=self.bi,
                          BJ=self.bj, PARTS=parts, HAS_POST=post is not None, STAGE_INPUT=stage_input,
                          num_warps=self.warps)


class GpuWeight:
    """A KernelWeight's stored parts on the GPU, with `matvec(x)` for a float32 vector on that device."""

    BLOCK_R = 16
    BLOCK_C = 128
    AFFINE_W = 128  # the affine word kernel's words (of 8 rows) an iteration
    # the nibble kernel's launch (`tune`): words (of 32 rows x 8 coordinates) an iteration, software pipeline
    # stages (1: plain loads), warps a program. Not measured on a GPU yet: bench/gpu.py times the alternatives
    NIBBLE_W = 32
    NIBBLE_STAGES = 1
    NIBBLE_WARPS = 4

    def __init__(self, weight):
        import torch

        from accel.kernels.weights import AffineWeight, LeechWeight

        device = _device()
        if device is None:
            raise RuntimeError("Triton kernels need triton and a CUDA device")
        self.cpu = weight
        self.shape = weight.shape

        def dev(a):
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        if isinstance(weight, AffineWeight):
            if weight.base_b > 24:
                raise TypeError(f"the Triton base-L kernel reads group values of at most 24 bits, not {weight.base_b}")
            stored = weight.stored()  # the stored layout, not the CPU kernels' tile copy
            per_word = 32 // weight.bits
            wpg = weight.group // per_word
            if (weight.base_g == 0 and weight.bits in (8, 4, 2) and weight.group % per_word == 0
                    and wpg & (wpg - 1) == 0 and wpg <= 64):
                self.kind = "affine-words"  # 8-row tiles of 32-bit words
                words, scale, offset = affine_words(stored["codes"], stored["scale"], stored.get("offset"),
                                                    weight.bits, *self.shape, weight.group)
                self.codes, self.scale = dev(words.view(np.int32)), dev(scale)
                self.offset = self.scale if offset is None else dev(offset)
                self.wpg, self.nwords = wpg, words.shape[1]
            else:  # other widths and groups, base-L: the stored stream
                self.kind = "affine"
                self.codes = dev(stored["codes"])
                self.scale = dev(stored["scale"].reshape(self.shape[0], -1).astype(np.float32))
                self.offset = (dev(stored["offset"].reshape(self.shape[0], -1).astype(np.float32))
                               if "offset" in stored else self.scale)
        elif isinstance(weight, LeechWeight):
            self.kind = "leech"
            rows, cols = self.shape[0], weight.cols
            onehot = weight.kind == "leech-onehot"
            self.stages = []  # (kind, stored arrays, alpha, launch constants) per stage
            for stream, param, alpha in zip(weight.streams, weight._params, weight._alphas, strict=True):
                if not onehot and param == 4:  # the nibble copy: the same bits, one coordinate a nibble
                    nib, par = leech_nibbles(stream, rows, cols)
                    self.stages.append(("nibble", (dev(nib.view(np.int32)), dev(par.view(np.int32))), float(alpha),
                                        {"pwords": par.shape[1]}))
                else:  # 3-plane and one-hot stages: the stored stream
                    self.stages.append(("stored", (dev(stream),), float(alpha),
                                        {"ONEHOT": int(onehot), "PARAM": int(param),
                                         "NPLANES": int(param) + int(onehot)}))
            self.scale = dev(weight.scale.view(np.float16).astype(np.float32))
            self.transforms = {side: _Transform(signs, mat, odd, dev)
                               for side, (signs, mat, odd) in weight.factors.items()}
            self.z = torch.empty(9 * cols // 8, dtype=torch.float32, device=device)
            self.tune(self.NIBBLE_W, self.NIBBLE_STAGES, self.NIBBLE_WARPS)
        else:
            raise TypeError(f"no GPU kernel for {type(weight).__name__}")

    def clone(self) -> GpuWeight:
        """The same weight in its own device memory (benchmarks cycle through copies so that the weights come from
        device memory, not from the L2 cache)."""
        import copy

        import torch

        twin = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(twin, name, value.clone())
        if self.kind == "leech":
            twin.stages = [(kind, tuple(a.clone() for a in args), alpha, const)
                           for kind, args, alpha, const in self.stages]
            twin.transforms = {}
            for side, transform in self.transforms.items():
                twin.transforms[side] = copy.copy(transform)
                twin.transforms[side].signs = transform.signs.clone()
                twin.transforms[side].mat = transform.mat.clone()
        return twin

    def tune(self, block_w: int, stages: int, warps: int) -> None:
        """Set the nibble kernel's launch: block_w words an iteration (a power of two), stages of Triton's software
        pipeline (1: none), warps a program. A nibble stage's words are split among programs per 32-row tile, in
        whole iterations, so that there are some 1024 programs or more (all resident at once on an H100, with
        more bytes in flight than one program each per SM would keep); each split keeps its own partial row sums
        (rows of t), which the output transform adds up."""
        import torch

        rows, words = self.shape[0], self.cpu.cols // 8
        self.block_w, self.pipeline, self.warps = int(block_w), int(stages), int(warps)
        want = max(1, min(8, -(-1024 // -(-rows // 32))))
        self.wsplit = -(-words // (want * self.block_w)) * self.block_w
        self.splits = -(-words // self.wsplit)
        self.parts = self.splits if any(kind == "nibble" for kind, *_ in self.stages) else 1
        self.t = torch.empty((self.parts, rows), dtype=torch.float32, device=self.z.device)

    def matvec(self, x):
        import torch

        rows, cols = self.shape
        w = self.cpu
        if self.kind == "affine-words":
            y = torch.empty(rows, dtype=torch.float32, device=x.device)
            _affine_words_kernel[(triton.cdiv(rows, 8),)](
                self.codes, self.scale, self.offset, x, y, rows, cols, self.nwords, -(-cols // w.group), w.levels,
                0x4B000000, BITS=w.bits, WPG=self.wpg, BLOCK_W=self.AFFINE_W, SYMMETRIC=w.symmetric)
            return y
        if self.kind == "affine":
            y = torch.empty(rows, dtype=torch.float32, device=x.device)
            _affine_kernel[(triton.cdiv(rows, self.BLOCK_R),)](
                self.codes, self.codes.numel(), self.scale, self.offset, x, y, rows, cols, self.scale.shape[1],
                w.group, w.levels, max(w.base_g, 1), max(w.base_b, 1), BITS=w.bits, SYMMETRIC=w.symmetric,
                BASE=w.base_g > 0, BLOCK_R=self.BLOCK_R, BLOCK_C=self.BLOCK_C)
            return y
        # z = V [x; 0] as the stages read it, t = sum_s alpha_s P_s z, y = U^T diag(scale) t: a kernel each
        self.transforms["in"](x, cols, self.z, stage_input=True)
        self.run_stages()
        y = torch.empty(rows, dtype=torch.float32, device=x.device)
        self.transforms["out"](self.t, rows, y, pre=self.scale, post=self.transforms["out"].signs, parts=self.parts)
        return y

    def run_stages(self) -> None:
        """A Leech matvec's middle: t from z, every stage (bench/gpu.py also times it alone)."""
        rows, cols = self.shape[0], self.cpu.cols
        words, nblk = cols // 8, cols // 24
        zero_first = self.stages[0][0] != "nibble" and self.parts > 1  # a stored first stage writes part 0 only
        if zero_first:
            self.t.zero_()
        for i, (kind, args, alpha, const) in enumerate(self.stages):
            if kind == "nibble":
                _leech_nibble_kernel[(triton.cdiv(rows, 32), self.splits)](
                    *args, self.z, self.t, rows, words, const["pwords"], self.wsplit, alpha, 0x4B000000,
                    ACCUMULATE=i > 0, SPLITS=self.splits, BLOCK_W=self.block_w, STAGES=self.pipeline,
                    num_warps=self.warps)
            else:
                _leech_kernel[(triton.cdiv(rows, self.BLOCK_R),)](
                    *args, self.z, self.t, rows, cols, nblk, 3 * rows * nblk, alpha, ACCUMULATE=i > 0 or zero_first,
                    BLOCK_R=self.BLOCK_R, BLOCK_C=self.BLOCK_C, **const)


def gpu_weight(weight) -> GpuWeight:
    return GpuWeight(weight)
