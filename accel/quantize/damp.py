"""DAMP: keep the high-risk recurrent-state channels at higher precision, the rest in INT8 with per-channel scales.

`accel quantize MODEL --state damp[:ARG] --calib C --out D` ranks every channel (a d_k row of a head's state, in
every linear-attention layer) by a risk score from `accel calibrate --for state` and keeps the top channels in the
high format so that the average bits per state value, scales counted, is the largest not above the target.

ARG is `[BITS][,alloc=tiers|water][,rank=both|energy|persistence|random|sensitivity][,high=fp16|bf16|fp32][,low=FMT]`:
- BITS: target average bits per state value (default 9.9).
- alloc: `tiers` (default, the paper's DAMP) keeps the top channels in `high` and the rest in `low`; `water`
  gives every channel its own INT-K width (K = 2..16) by reverse water-filling (`water_fill`): it minimises
  Σ_c w_c · D_c(K_c), D_c the channel's measured error energy at width K, with Σ K_c fixed by BITS.
- rank: `both` (default for tiers) = INT8 error energy × persistence; `energy` or `persistence` alone;
  `sensitivity` (default for water) = the gradient sensitivity of the loss to the channel (× its error energy);
  `random` (seeded by `--seed`) is the ablation that mixes the same formats without a ranking.
- high: the format of the kept channels (default fp16). low: the rest (default int8; below int8's own bits the
  default pair becomes int4 / int8, the adjacent tiers). alloc=tiers only.
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
RANKINGS = ("both", "energy", "persistence", "random", "sensitivity")
HIGH_FORMATS = ("fp16", "bf16", "fp32")
ALLOCATIONS = ("tiers", "water")
WATER_BITS = tuple(range(2, 17))  # the INT-K widths water-filling chooses from (K bits + a float16 scale a row)


@dataclass(frozen=True)
class DampSpec:
    bits: float = DEFAULT_BITS
    rank: str = "both"
    high: str | None = None
    low: str | None = None
    alloc: str = "tiers"
    # rank's default: `both` (energy × persistence) for alloc=tiers, `sensitivity` for alloc=water (see parse)

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
        if key in fields:
            raise AccelError(f"--state damp:{arg}: option {key} is given twice")
        if key == "rank":
            if value not in RANKINGS:
                raise AccelError(f"--state damp: rank={value!r}; choose from {', '.join(RANKINGS)}")
            fields["rank"] = value
        elif key in ("high", "low"):
            fields[key] = check_format(value)
        elif key == "alloc":
            if value not in ALLOCATIONS:
                raise AccelError(f"--state damp: alloc={value!r}; choose from {', '.join(ALLOCATIONS)}")
            fields["alloc"] = value
        else:
            raise AccelError(f"--state damp: unknown option {key!r} (rank, alloc, high, low)")
    if fields.get("alloc") == "water" and "rank" not in fields:
        fields["rank"] = "sensitivity"
    spec = DampSpec(**fields)
    if spec.alloc == "water" and (spec.high or spec.low):
        raise AccelError("--state damp: alloc=water chooses each channel's INT-K width itself (int2..int16); "
                         "high= and low= are for alloc=tiers")
    if spec.high is not None and spec.high not in HIGH_FORMATS:
        raise AccelError(f"--state damp: high={spec.high}; choose from {', '.join(HIGH_FORMATS)}")
    if not np.isfinite(spec.bits) or spec.bits <= 0:
        raise AccelError(f"--state damp: target bits must be a positive number, got {spec.bits}")
    return spec


def _required_sensitivity(sensitivity: np.ndarray | None) -> np.ndarray:
    """The calibration's gradient sensitivities, which rank=sensitivity needs (older calibrations have none)."""
    if sensitivity is None:
        raise AccelError("--state damp: rank=sensitivity needs a calibration with state sensitivities "
                         "(rerun `accel calibrate MODEL --for state`)")
    return _informative("sensitivities", sensitivity)


def _informative(what: str, values: np.ndarray) -> np.ndarray:
    """A calibration statistic a map is ranked by: finite and not all zero, or the ranking is no ranking (windows
    of one segment recorded all-zero sensitivities, and a water map built on them cost 0.5 nats a token)."""
    values = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(values)):
        raise AccelError(f"--state damp: the calibration's state {what} hold NaN or Inf: calibrate again")
    if values.size and not np.any(values > 0):
        raise AccelError(f"--state damp: the calibration's state {what} are all zero (its windows never read the "
                         f"recurrent state): calibrate again with a longer --seq-len")
    return values


def risk_score(energy: np.ndarray, persistence: np.ndarray, rank: str, seed: int = 0,
               sensitivity: np.ndarray | None = None) -> np.ndarray:
    energy, persistence = _informative("error energies", energy), _informative("persistences", persistence)
    if rank == "both":
        return energy * persistence
    if rank == "sensitivity":
        return energy * _required_sensitivity(sensitivity)
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
    if bits > b_hi + 1e-9:
        raise AccelError(f"--state damp:{bits:g} is above {high} for every channel ({b_hi:g} bits per value at d_v "
                         f"{shape.d_v}); choose at most that, or a wider high= format")
    total = shape.channels
    n_high = min(total, int(np.floor((bits - b_lo) * total / (b_hi - b_lo) + 1e-9)))
    order = np.argsort(-score.reshape(-1), kind="stable")
    mask = np.zeros(total, dtype=np.uint8)
    mask[order[:n_high]] = 1
    achieved = (n_high * b_hi + (total - n_high) * b_lo) / total
    return mask.reshape(len(shape.layers), shape.heads, shape.d_k), float(achieved)


def water_fill(loss: np.ndarray, steps: int) -> np.ndarray:
    """Steps taken per row of `loss` [channels, tiers] (tier t costs t steps), `steps` in all, minimising the sum.

    Greedy marginal gain: every step (channel c from tier t to t + 1) gains loss[c, t] - loss[c, t + 1]; the
    `steps` largest gains are taken, ties in channel-then-tier order. Each channel's gains are first made
    non-increasing (a running minimum), so every channel takes a prefix of its own steps and a larger budget
    takes a superset of the steps (no channel ever loses a tier). Where each channel's loss is convex in its
    tier (as r·4^-K is) this is the optimum of the integer problem, exactly: all steps cost the same.
    """
    c, t = loss.shape
    gains = np.minimum.accumulate(loss[:, :-1] - loss[:, 1:], axis=1)
    steps = int(min(max(steps, 0), c * (t - 1)))
    order = np.argsort(-gains.reshape(-1), kind="stable")[:steps]
    taken = np.zeros(c * (t - 1), dtype=bool)
    taken[order] = True
    return taken.reshape(c, t - 1).sum(axis=1)


def water_weights(stats: dict[str, np.ndarray], rank: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(weight [L, H, d_k], error energy [tiers, L, H, d_k]): channel c's expected loss at width K is
    weight[c] · energy[K, c]. both: persistence × measured energy; sensitivity: the measured gradient sensitivity
    × measured energy; energy: energy alone; persistence / random: that weight × the mean energy curve (the
    channels' own energies ignored, the ablations)."""
    e8 = _informative("error energies", stats["energy"])
    tiers = stats.get("energy_tiers")
    if tiers is None:  # a calibration from before tier energies were recorded: the 4^-K model from INT8's energy
        tiers = np.stack([e8 * 4.0 ** (8 - k) for k in WATER_BITS])
    tiers = np.asarray(tiers, dtype=np.float64)
    if tiers.shape[0] != len(WATER_BITS):
        raise AccelError(f"the calibration's energy_tiers has {tiers.shape[0]} widths, expected {len(WATER_BITS)}")
    if rank in ("persistence", "random"):
        tiers = np.broadcast_to(tiers.mean(axis=(1, 2, 3), keepdims=True), tiers.shape)
    if rank == "both":
        weight = stats["persistence"]
    elif rank == "sensitivity":
        weight = _required_sensitivity(stats.get("sensitivity"))
    elif rank == "energy":
        weight = np.ones_like(e8)
    elif rank == "persistence":
        weight = stats["persistence"]
    else:
        weight = np.random.default_rng(seed).random(e8.shape)
    return np.asarray(weight, dtype=np.float64), tiers


def water_map(stats: dict[str, np.ndarray], shape: StateShape, spec: DampSpec, seed: int = 0) -> StoredMap:
    """Risk-weighted bit allocation: each channel gets INT-K, K in 2..16, the total fixed by the target bits."""
    weight, tiers = water_weights(stats, spec.rank, seed)
    loss = (weight[None] * tiers).reshape(len(WATER_BITS), -1).T  # [channels, widths]
    base = row_bits(f"int{WATER_BITS[0]}", shape.d_v)
    lo, hi = base, row_bits(f"int{WATER_BITS[-1]}", shape.d_v)
    if not lo <= spec.bits + 1e-9:
        raise AccelError(f"--state damp:{spec.bits:g},alloc=water is below int{WATER_BITS[0]} alone ({lo:g} bits "
                         f"per value at d_v {shape.d_v})")
    if spec.bits > hi + 1e-9:
        raise AccelError(f"--state damp:{spec.bits:g},alloc=water is above int{WATER_BITS[-1]} for every channel "
                         f"({hi:g} bits per value at d_v {shape.d_v})")
    # one step = one more bit for each of a row's d_v values; the budget in steps, scales counted in `base`
    steps = int(np.floor((spec.bits - base) * shape.channels + 1e-6))
    taken = water_fill(loss, steps)
    widths = (WATER_BITS[0] + taken).astype(np.uint8).reshape(len(shape.layers), shape.heads, shape.d_k)
    achieved = water_bits(widths, shape.d_v)
    counts = {f"int{k}": int((widths == k).sum()) for k in WATER_BITS if (widths == k).any()}
    params = {"alloc": "water", "target_bits": spec.bits, "bits_per_value": achieved, "rank": spec.rank,
              "seed": seed, "shape": shape.to_json(), "channels": shape.channels, "widths": counts}
    return StoredMap("state", "damp", params, {"bits": widths, "score": weight.astype(np.float32)})


def water_bits(widths: np.ndarray, d_v: int) -> float:
    """Bits per value of a water-filled map: K code bits plus a float16 scale per row, averaged over rows."""
    return float(np.mean(np.asarray(widths, dtype=np.float64)) + 16.0 / d_v)


def damp_map(stats: dict[str, np.ndarray], shape: StateShape, spec: DampSpec, seed: int = 0) -> StoredMap:
    """The map for `spec` from calibration statistics (`energy`, `persistence`, and for alloc=water or
    rank=sensitivity `energy_tiers` / `sensitivity`)."""
    if spec.alloc == "water":
        return water_map(stats, shape, spec, seed)
    high, low = spec.formats(shape.d_v)
    score = risk_score(stats["energy"], stats["persistence"], spec.rank, seed, stats.get("sensitivity"))
    mask, achieved = select_channels(score, shape, spec.bits, high, low)
    params = {"alloc": "tiers", "target_bits": spec.bits, "bits_per_value": achieved, "rank": spec.rank, "high": high, "low": low,
              "seed": seed, "shape": shape.to_json(), "high_channels": int(mask.sum()), "channels": shape.channels}
    return StoredMap("state", "damp", params, {"high": mask, "score": score.astype(np.float32)})


class Damp(MapMethod, kind="state", name="damp"):
    description = ("DAMP channel map: high-risk channels in fp16, the rest INT8, or (alloc=water) an INT-K width "
                   "per channel (needs --calib from --for state)")

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
        return damp_map(arrays, shape, spec, ctx.seed)

    def check(self, stored: StoredMap, config: dict[str, Any]) -> None:
        shape = state_shape(config)
        check_shape(stored, shape)
        expected = (len(shape.layers), shape.heads, shape.d_k)
        alloc = stored.params.get("alloc", "tiers")
        if alloc not in ALLOCATIONS:
            raise AccelError(f"the state map's allocation {alloc!r} is unknown ({', '.join(ALLOCATIONS)})")
        if alloc == "water":
            widths = stored.arrays.get("bits")
            if widths is None or tuple(widths.shape) != expected:
                got = None if widths is None else tuple(widths.shape)
                raise AccelError(f"the state map's channel widths are {got}, the model needs {expected} "
                                 f"({shape.describe()})")
            if widths.size and (widths.min() < WATER_BITS[0] or widths.max() > WATER_BITS[-1]):
                raise AccelError(f"the state map's channel widths hold {int(widths.min())}..{int(widths.max())}; "
                                 f"each must be an INT-K width in {WATER_BITS[0]}..{WATER_BITS[-1]}")
            recorded, actual = stored.params.get("bits_per_value"), water_bits(widths, shape.d_v)
            if not isinstance(recorded, (int, float)) or abs(recorded - actual) > 1e-6:
                raise AccelError(f"the state map records {recorded} bits per value but its channel widths "
                                 f"give {actual:.6f}")
            return
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
        if stored.params.get("alloc") == "water":
            widths = np.asarray(stored.arrays["bits"]).reshape(len(shape.layers), -1)
            return StateRuntime(model, StateScheme(shape, low="int8", row_formats={
                layer: [f"int{int(k)}" for k in widths[i]] for i, layer in enumerate(shape.layers)}))
        scheme = StateScheme(shape, low=stored.params["low"], high=stored.params["high"],
                             masks=masks_from_array(stored.arrays["high"], shape))
        return StateRuntime(model, scheme)
