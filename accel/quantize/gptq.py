"""Error feedback over column blocks (GPTQ / block LDLQ): quantize a block, push its error onto later columns.

With U the upper Cholesky factor of H^{-1}, quantizing columns [a, b) jointly to Q leaves error E = W[:, a:b] - Q,
and the columns after b absorb W[:, b:] -= E · U[a:b, a:b]^{-1} · U[a:b, b:]. With blocks of one column this is
GPTQ; with 24-column blocks and a lattice quantizer it is block LDLQ (QuIP#). The quantizer sees the already
corrected columns, so its own rounding choices are fed back.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from accel.errors import AccelError

# (first column a, W[:, a:stop] with every feedback so far applied; its first `block` columns are the block)
# -> dequantized Q of the block
BlockQuantizer = Callable[[int, np.ndarray], np.ndarray]


def damped_inverse_cholesky(h: np.ndarray, damp: float = 0.01) -> np.ndarray:
    """Upper Cholesky factor U of (H + damp·mean(diag H)·I)^{-1}; dead inputs (zero diagonal) get unit weight."""
    h = np.array(h, dtype=np.float64, copy=True)
    if not np.isfinite(h).all():
        raise AccelError("the layer's Hessian holds NaN or Inf (its calibration inputs overflowed); calibrate again")
    diag = np.diag(h).copy()
    dead = diag <= 0
    h[dead, dead] = 1.0
    mean = float(np.mean(np.diag(h)))
    h[np.diag_indices_from(h)] += damp * mean
    for extra in (0.0, 0.1, 1.0, 10.0):  # more damping only if the matrix is numerically not positive definite
        try:
            low = np.linalg.cholesky(h + extra * mean * np.eye(len(h)))
            inv = np.linalg.inv(low)
            return np.linalg.cholesky(inv.T @ inv).T
        except np.linalg.LinAlgError:
            continue
    raise np.linalg.LinAlgError("Hessian is not positive definite even after damping")


def error_feedback(w: np.ndarray, u: np.ndarray, block: int, quantize: BlockQuantizer,
                   lazy: int = 128) -> np.ndarray:
    """Quantize W (rows, cols) block by block with error feedback through U; returns the dequantized weights.

    `lazy` columns are updated together (GPTQ's lazy batch), which changes nothing but the speed. The quantizer
    also sees the rest of the batch, already corrected, so a grouped grid can be fixed when its group starts
    (keep `lazy` a multiple of the group size).
    """
    w = np.array(w, dtype=np.float64, copy=True)
    rows, cols = w.shape
    if cols % block:
        raise ValueError(f"{cols} columns are not whole blocks of {block}")
    lazy = max(block, lazy - lazy % block)
    out = np.empty_like(w)
    for start in range(0, cols, lazy):
        stop = min(cols, start + lazy)
        pending = np.zeros((rows, stop - start))  # scaled errors of this batch, for the columns after it
        for a in range(start, stop, block):
            b = a + block
            q = quantize(a, w[:, a:stop])
            out[:, a:b] = q
            ub = u[a:b, a:b]
            scaled = np.linalg.solve(ub.T, (w[:, a:b] - q).T).T  # E · U_bb^{-1}
            w[:, b:stop] -= scaled @ u[a:b, b:stop]
            pending[:, a - start : b - start] = scaled
        w[:, stop:] -= pending @ u[start:stop, stop:]
    return out


def proxy_loss(w: np.ndarray, q: np.ndarray, h: np.ndarray) -> float:
    """tr((W-Q) H (W-Q)^T): the layer-output error the feedback minimises."""
    e = np.asarray(w, dtype=np.float64) - q
    return float(np.einsum("ij,jk,ik->", e, h, e))
