"""DAMP: keep the high-risk recurrent-state channels at higher precision, the rest in INT8 with per-channel scales.

`accel quantize MODEL --state damp[:ARG] --calib C --out D` ranks every channel (a d_k row of a head's state, in
every linear-attention layer) by a risk score from `accel calibrate --for state` and keeps the top channels in the
high format so that the average bits per state value, scales counted, is the largest not above the target.

ARG is `[BITS][,rank=both|energy|persistence|random][,high=fp16|bf16|fp32][,low=FMT]`:
- BITS: target average bits per state value (default 9.9).
- rank: `both` (default) = INT8 error energy × persistence; `energy` or `persistence` alone; `random` (seeded by
  `--seed`) is the ablation that mixes the same formats without a ranking.
- high: the format of the kept channels (default fp16). low: the rest (default int8; below int8's own bits the
  default pair becomes int4 / int8, the adjacent tiers).
Persistence is per head in GDN, so `rank=persistence` keeps whole heads there (ties in channel order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from accel.errors import AccelError
from accel.quantize.maps import BuildContext, MapMethod, StoredMap
from accel.runtime.state_cache import (
    StateRuntime,
    StateScheme,
    check_format,
    check_shape,
    masks_from_array,
    row_bits,
)
from accel.runtime.state_shapes import StateShape, state_shape

DEFAULT_BITS = 9.9
RANKINGS = ("both", "energy", "persistence", "random")
HIGH_FORMATS = ("fp16", "bf16", "fp32")


@dataclass(frozen=True)
class DampSpec:
    bits: float = DEFAULT_BITS
    rank: str = "both"
    high: str | None = None
    low: str | None = None

    def formats(self, d_v: int) -> tuple[str, str]:
        """(high, low): the defaults step down to int8 / int4 when the target is below INT8's own bits."""
        below_int8 = self.bits < row_bits("int8", d_v)
        low = self.low or ("int4" if below_int8 else "int8")
        high = self.high or ("int8" if below_int8 and self.low is None else "fp16")
        return high, low


def parse_damp_arg(arg: str | None) -> DampSpec:
    if not arg:
        return DampSpec()
    fields: dict[str, Any] = {}
    for i, item in enumerate(a.strip() for a in arg.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            if i != 0:
                raise AccelError(f"--state damp:{arg}: {item!r} is not KEY=VALUE (bits come first)")
            try:
                fields["bits"] = float(item)
            except ValueError:
                raise AccelError(f"--state damp:{arg}: {item!r} is not a number of bits per value") from None
            continue
        if key == "rank":
            if value not in RANKINGS:
                raise AccelError(f"--state damp: rank={value!r}; choose from {', '.join(RANKINGS)}")
            fields["rank"] = value
        elif key in ("high", "low"):
            fields[key] = check_format(value)
        else:
            raise AccelError(f"--state damp: unknown option {key!r} (rank, high, low)")
    spec = DampSpec(**fields)
    if spec.high is not None and spec.high not in HIGH_FORMATS:
        raise AccelError(f"--state damp: high={spec.high}; choose from {', '.join(HIGH_FORMATS)}")
    if not np.isfinite(spec.bits) or spec.bits <= 0:
        raise AccelError(f"--state damp: target bits must be a positive number, got {spec.bits}")
    return spec


def risk_score(energy: np.ndarray, persistence: np.ndarray, rank: str, seed: int = 0) -> np.ndarray:
    if rank == "both":
        return energy * persistence
    if rank == "energy":
        return energy.copy()
    if rank == "persistence":
        return persistence.copy()
    return np.random.default_rng(seed).random(energy.shape)


def select_channels(score: np.ndarray, shape: StateShape, bits: float, high: str, low: str
                    ) -> tuple[np.ndarray, float]:
    """0/1 [layers, heads, d_k] of the channels kept in `high`, and the bits per value it gives.

    The count is the largest whose average (scales counted) does not exceed `bits`; channels go in order of
    decreasing score, ties in index order.
    """
    b_hi, b_lo = row_bits(high, shape.d_v), row_bits(low, shape.d_v)
    if b_hi <= b_lo:
        raise AccelError(f"--state damp: high={high} ({b_hi:g} bits) is not above low={low} ({b_lo:g} bits)")
    if not b_lo <= bits + 1e-9:
        raise AccelError(f"--state damp:{bits:g} is below {low} alone ({b_lo:g} bits per value at d_v "
                         f"{shape.d_v}); choose at least that, or a lower low= format")
    total = shape.channels
    n_high = min(total, int(np.floor((bits - b_lo) * total / (b_hi - b_lo) + 1e-9)))
    order = np.argsort(-score.reshape(-1), kind="stable")
    mask = np.zeros(total, dtype=np.uint8)
    mask[order[:n_high]] = 1
    achieved = (n_high * b_hi + (total - n_high) * b_lo) / total
    return mask.reshape(len(shape.layers), shape.heads, shape.d_k), float(achieved)


def damp_map(energy: np.ndarray, persistence: np.ndarray, shape: StateShape, spec: DampSpec, seed: int = 0
             ) -> StoredMap:
    high, low = spec.formats(shape.d_v)
    score = risk_score(energy, persistence, spec.rank, seed)
    mask, achieved = select_channels(score, shape, spec.bits, high, low)
    params = {"target_bits": spec.bits, "bits_per_value": achieved, "rank": spec.rank, "high": high, "low": low,
              "seed": seed, "shape": shape.to_json(), "high_channels": int(mask.sum()), "channels": shape.channels}
    return StoredMap("state", "damp", params, {"high": mask, "score": score.astype(np.float32)})


class Damp(MapMethod, kind="state", name="damp"):
    description = "DAMP channel map: high-risk channels in fp16, the rest INT8 (needs --calib from --for state)"

    def build(self, arg: str | None, ctx: BuildContext) -> StoredMap:
        from accel.calibrate.state import read_state_stats

        spec = parse_damp_arg(arg)
        shape = state_shape(ctx.config)
        if ctx.calib is None:
            raise AccelError("--state damp needs --calib (run `accel calibrate MODEL --for state` first)")
        arrays, doc = read_state_stats(ctx.calib)
        try:
            check_shape(StoredMap("state", "calibration", {"shape": doc["shape"]}), shape)
        except AccelError as err:
            raise AccelError(f"--calib {ctx.calib} was recorded on another model: "
                             f"{str(err).replace('the state map is', 'its state statistics are')}") from None
        return damp_map(arrays["energy"], arrays["persistence"], shape, spec, ctx.seed)

    def check(self, stored: StoredMap, config: dict[str, Any]) -> None:
        shape = state_shape(config)
        check_shape(stored, shape)
        expected = (len(shape.layers), shape.heads, shape.d_k)
        high = stored.arrays.get("high")
        if high is None or tuple(high.shape) != expected:
            got = None if high is None else tuple(high.shape)
            raise AccelError(f"the state map's channel mask is {got}, the model needs {expected} "
                             f"({shape.describe()})")
        if high.size and (high.min() < 0 or high.max() > 1):
            raise AccelError("the state map's channel mask holds values other than 0 and 1")
        check_format(str(stored.params.get("high")))
        check_format(str(stored.params.get("low")))

    def runtime(self, stored: StoredMap, model: Any) -> StateRuntime:
        shape = state_shape(model.config)
        scheme = StateScheme(shape, low=stored.params["low"], high=stored.params["high"],
                             masks=masks_from_array(stored.arrays["high"], shape))
        return StateRuntime(model, scheme)
