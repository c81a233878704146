"""SemKV precision maps: `--kv semkv[:SPEC]` (calibrated) and the uniform `--kv affine:L` / `--kv turbo:L`.

A SemKV map keeps every token and gives each one of two adjacent level counts (LLO < LHI) of one base quantizer:
tokens whose write-time score (key or value norm, averaged over heads) exceeds the layer's threshold get LHI.
The thresholds are the calibration's per-layer (1 - FRAC) quantiles of that score, so about FRAC of the tokens
land at LHI. `accel quantize --kv semkv[:SPEC] --calib C` writes it; SPEC is

    auto                 the calibration's recommendation (the base with the larger reduction at no detectable loss)
    BASE  | BASE:auto    the recommendation for one base (affine or turbo)
    LLO/LHI@FRAC         explicit levels and fraction, on the recommended base
    BASE:LLO/LHI@FRAC    explicit everything

Map document (`maps.kv`): method `semkv` (or `affine`/`turbo` for uniform eval-time schemes), params `base`,
`levels` [LLO, LHI], `frac`, `indicator`, `seed`, `key_block`, `value_group`, `window`, `sink` (first tokens kept
in fp16), `pre_rope` (0/1: keys coded before RoPE) with `rope_theta` (the model's, checked on load), `layers`,
`kv_heads`, `head_dim`; arrays `thresholds` (float32 [layers]); for turbo `codebook_low`/`codebook_high` (the
Lloyd-Max centroids, float32, for an independent reader; checked against the solver on load) and, when
calibrated, `key_mean`/`value_mean` ([layers, kv_heads, head_dim], subtracted before coding, added back; the key
mean is of pre-RoPE keys when `pre_rope`) and `key_scale` (same shape, > 0: centered keys are divided by it
before coding, multiplied back on decode). See docs/semkv.md.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from accel.errors import AccelError, FormatError
from accel.formats import jsontext
from accel.quantize.maps import BuildContext, MapMethod, Runtime, StoredMap
from accel.runtime.kv_cache import (
    BASES,
    RUNTIME_INDICATORS,
    KVScheme,
    PackedKVCache,
    fp16_bytes_per_token,
    model_kv_shape,
    rope_theta_of,
)

KV_CALIB_DIR = "kv"
_COMMON = {"value_group": 64, "window": 0, "sink": 0, "pre_rope": 0}
DEFAULTS = {"affine": {"key_block": 32, **_COMMON}, "turbo": {"key_block": 1, **_COMMON},
            "fp16": {"key_block": 1, **_COMMON}}
OPTION_KEYS = (  # the map params that set up the cache (calibrate --for kv writes them too)
    "key_block", "value_group", "window", "sink", "pre_rope")
_OPTIONAL_KEYS = {"sink": 0, "pre_rope": 0}  # absent from maps written before they existed


def _parse_levels(text: str) -> tuple[int, int, float]:
    """'LLO/LHI@FRAC' -> (LLO, LHI, FRAC)."""
    try:
        pair, _, frac_text = text.partition("@")
        lo_text, _, hi_text = pair.partition("/")
        lo, hi = int(lo_text), int(hi_text)
        frac = float(frac_text)
    except ValueError:
        raise AccelError(f"--kv semkv:{text}: expected LLO/LHI@FRAC, for example 5/6@0.25") from None
    if not (math.isfinite(frac) and 0.0 <= frac <= 1.0):
        raise AccelError(f"--kv semkv:{text}: FRAC must lie in [0, 1]")
    _check_levels([lo, hi])
    if hi <= lo:
        raise AccelError(f"--kv semkv:{text}: LHI must exceed LLO")
    return lo, hi, frac


def _check_levels(levels: Any) -> tuple[int, int]:
    if not isinstance(levels, (list, tuple)) or len(levels) != 2 or not all(isinstance(v, int) for v in levels):
        raise AccelError("the kv map's levels must be two integers [LLO, LHI]")
    for v in levels:
        if not 2 <= v <= 256:
            raise AccelError(f"the kv map asks for L = {v}; KV levels must lie in 2..256")
    return int(levels[0]), int(levels[1])


def make_params(base: str, levels: tuple[int, int], frac: float, indicator: str, seed: int,
                config: dict[str, Any], **options: int) -> dict[str, Any]:
    layers, kv_heads, head_dim = model_kv_shape(config)
    opts = {**DEFAULTS[base], **options}
    params = {"base": base, "levels": [int(levels[0]), int(levels[1])], "frac": float(frac), "indicator": indicator,
              "seed": int(seed), **{k: int(opts[k]) for k in OPTION_KEYS}, "layers": layers, "kv_heads": kv_heads,
              "head_dim": head_dim}
    if params["pre_rope"] not in (0, 1):
        raise AccelError("the kv option pre_rope is 0 or 1")
    if params["pre_rope"]:
        theta = rope_theta_of(config)
        if theta is None:
            raise AccelError("pre_rope=1 needs a model with plain (default, full-head) RoPE; this one scales it")
        params["rope_theta"] = theta
    return params


def make_arrays(params: dict[str, Any], thresholds: np.ndarray | None) -> dict[str, np.ndarray]:
    from accel.quantize.turboquant import lloyd_max

    arrays: dict[str, np.ndarray] = {}
    if thresholds is not None:
        arrays["thresholds"] = np.asarray(thresholds, dtype=np.float32)
    if params["base"] == "turbo":
        lo, hi = params["levels"]
        arrays["codebook_low"] = lloyd_max(lo, params["head_dim"])[0].astype(np.float32)
        arrays["codebook_high"] = lloyd_max(hi, params["head_dim"])[0].astype(np.float32)
    return arrays


def check_kv_map(stored: StoredMap, config: dict[str, Any]) -> None:
    """Refuse a map that does not fit the model or names what this accel does not know (AccelError)."""
    p = stored.params
    base = p.get("base")
    if base not in BASES:
        raise AccelError(f"the kv map names an unknown base quantizer {base!r} (known: {', '.join(BASES)})")
    lo, hi = _check_levels(p.get("levels"))
    if lo > hi:
        raise AccelError("the kv map's levels must be [LLO, LHI] with LLO <= LHI")
    if p.get("indicator") not in RUNTIME_INDICATORS:
        raise AccelError(f"the kv map's score indicator {p.get('indicator')!r} is not one the cache can compute "
                         f"when a token is written ({', '.join(RUNTIME_INDICATORS)})")
    layers, kv_heads, head_dim = model_kv_shape(config)
    want = (p.get("layers"), p.get("kv_heads"), p.get("head_dim"))
    if want != (layers, kv_heads, head_dim):
        raise AccelError(f"the kv map is for {want[0]} layers x {want[1]} KV heads x {want[2]} dims, the model has "
                         f"{layers} x {kv_heads} x {head_dim}: it was made for a different model")
    for key in OPTION_KEYS:
        value = p.get(key, _OPTIONAL_KEYS.get(key))
        positive = key in ("key_block", "value_group")
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if positive else 0):
            raise AccelError(f"the kv map's {key} must be a {'positive' if positive else 'non-negative'} integer")
    if p.get("pre_rope", 0) not in (0, 1):
        raise AccelError("the kv map's pre_rope must be 0 or 1")
    if p.get("pre_rope", 0):
        theta = rope_theta_of(config)
        if theta is None:
            raise AccelError("the kv map codes keys before RoPE (pre_rope) but the model does not use plain RoPE")
        if not isinstance(p.get("rope_theta"), (int, float)) or float(p["rope_theta"]) != theta:
            raise AccelError(f"the kv map's rope_theta {p.get('rope_theta')!r} is not the model's ({theta}): it was "
                             f"made for a different model")
    if not isinstance(p.get("frac"), (int, float)) or not 0.0 <= p["frac"] <= 1.0:
        raise AccelError("the kv map's frac must lie in [0, 1]")
    thresholds = stored.arrays.get("thresholds")
    if lo != hi and (thresholds is None or thresholds.shape != (layers,) or np.isnan(thresholds).any()):
        raise AccelError(f"the kv map needs one threshold per layer ({layers}), none NaN")
    for name in ("key_mean", "value_mean", "key_scale"):
        mean = stored.arrays.get(name)
        if mean is not None and mean.shape != (layers, kv_heads, head_dim):
            raise AccelError(f"the kv map's {name} is {list(mean.shape)}, the model needs "
                             f"{[layers, kv_heads, head_dim]}")
    scale = stored.arrays.get("key_scale")
    if scale is not None:
        if base != "turbo":
            raise AccelError("the kv map's key_scale smooths per-token key coding; only the turbo base takes it")
        if not (np.isfinite(scale).all() and (scale > 0).all()):
            raise AccelError("the kv map's key_scale must be finite and positive")
    if base == "turbo":
        from accel.quantize.turboquant import lloyd_max

        for name, level in (("codebook_low", lo), ("codebook_high", hi)):
            book = stored.arrays.get(name)
            ref = lloyd_max(level, head_dim)[0]
            if book is None or book.shape != ref.shape or not np.allclose(book, ref, atol=1e-6):
                raise FormatError(f"the kv map's {name} is not the Lloyd-Max codebook for L={level}, d={head_dim}")


def scheme_of(stored: StoredMap) -> KVScheme:
    p = stored.params
    lo, hi = p["levels"]
    thresholds = stored.arrays.get("thresholds")
    return KVScheme(base=p["base"], levels=(lo, hi),
                    thresholds=None if thresholds is None or lo == hi else tuple(float(t) for t in thresholds),
                    indicator=p["indicator"], seed=p["seed"], key_block=p["key_block"],
                    value_group=p["value_group"], window=p["window"], sink=p.get("sink", 0),
                    rope_theta=float(p["rope_theta"]) if p.get("pre_rope", 0) else 0.0,
                    key_mean=stored.arrays.get("key_mean"), value_mean=stored.arrays.get("value_mean"),
                    key_scale=stored.arrays.get("key_scale"))


class PackedKVRuntime(Runtime):
    """A fresh PackedKVCache per window; reports what the caches really held at the end of each window."""

    def __init__(self, scheme: KVScheme, model: Any):
        self.scheme, self.config = scheme, model.config
        self.layers = int(model.config.num_hidden_layers)
        self._current: PackedKVCache | None = None
        self.windows, self.tokens, self.high = 0, 0, 0.0
        self.bytes = {"codes": 0, "side": 0, "fp16": 0, "total": 0}

    def _finish(self) -> None:
        cache, self._current = self._current, None
        if cache is None or cache.tokens() == 0:
            return
        for key, n in cache.stored_bytes().items():
            self.bytes[key] += n
        self.high += cache.high_fraction() * cache.tokens()
        self.tokens += cache.tokens()
        self.windows += 1

    def make_cache(self) -> PackedKVCache:
        self._finish()
        self._current = PackedKVCache(self.scheme, self.layers)
        return self._current

    def report(self) -> dict[str, Any]:
        self._finish()
        fp16 = fp16_bytes_per_token(self.config)
        per_token = self.bytes["total"] / self.tokens if self.tokens else 0.0
        return {"kv_bytes_per_token": per_token, "kv_fp16_bytes_per_token": fp16,
                "kv_reduction": fp16 / per_token if per_token else None,
                "kv_bits_per_value": 8 * per_token / (fp16 / 2) if per_token else None,
                "kv_high_fraction": self.high / self.tokens if self.tokens else 0.0,
                "kv_bytes_breakdown": {k: v / self.tokens if self.tokens else 0.0 for k, v in self.bytes.items()
                                       if k != "total"}}


class _PackedMethod(MapMethod):
    def check(self, stored: StoredMap, config: dict[str, Any]) -> None:
        check_kv_map(stored, config)

    def runtime(self, stored: StoredMap, model: Any) -> Runtime:
        return PackedKVRuntime(scheme_of(stored), model)


def _parse_options(text: str | None, flag: str) -> tuple[str | None, dict[str, int]]:
    """'L[,key=value...]' -> ('L', {key: int})."""
    if text is None:
        return None, {}
    head, *rest = text.split(",")
    options = {}
    for item in rest:
        key, _, value = item.partition("=")
        if key not in OPTION_KEYS:
            raise AccelError(f"{flag}: unknown option {key!r} (known: {', '.join(OPTION_KEYS)})")
        if key in options:
            raise AccelError(f"{flag}: option {key} is given twice")
        try:
            options[key] = int(value)
        except ValueError:
            raise AccelError(f"{flag}: option {key} needs an integer, got {value!r}") from None
    return head or None, options


class _UniformMethod(_PackedMethod):
    """`--kv affine:L` / `--kv turbo:L[,window=W,key_block=G,value_group=g,sink=S,pre_rope=0|1]`: every token at
    L levels (uncalibrated: no centering or smoothing)."""

    base: str = ""

    def from_eval_spec(self, arg: str | None, config: dict[str, Any]) -> StoredMap:
        head, options = _parse_options(arg, f"--kv {self.name}")
        if head is None:
            raise AccelError(f"--kv {self.name} needs a level count, for example --kv {self.name}:5")
        try:
            levels = int(head)
        except ValueError:
            raise AccelError(f"--kv {self.name}:{head}: the level count must be an integer") from None
        _check_levels([levels, levels])
        params = make_params(self.base, (levels, levels), 0.0, "key_norm", 0, config, **options)
        return StoredMap("kv", self.name, params, make_arrays(params, None))


class AffineUniform(_UniformMethod, kind="kv", name="affine"):
    description = "uniform affine KV quantization (KIVI grouping) at L levels"
    base = "affine"


class TurboUniform(_UniformMethod, kind="kv", name="turbo"):
    description = "uniform TurboQuant-MSE KV quantization at L levels"
    base = "turbo"


class SemKV(_PackedMethod, kind="kv", name="semkv"):
    description = "SemKV: two adjacent above-cliff precisions per token, from a KV calibration"

    def build(self, arg: str | None, ctx: BuildContext) -> StoredMap:
        if ctx.calib is None:
            raise AccelError("--kv semkv needs --calib (run `accel calibrate MODEL --for kv` first)")
        calib = load_kv_calibration(ctx.calib, ctx.config)
        flag = f"--kv semkv:{arg}" if arg else "--kv semkv"
        base, spec = None, arg or "auto"
        head, _, rest = spec.partition(":")
        if head in ("affine", "turbo"):
            base, spec = head, rest or "auto"
        elif head in BASES:
            raise AccelError(f"{flag}: the base must be affine or turbo")
        elif "/" not in head and head != "auto":
            raise AccelError(f"{flag}: unknown base quantizer {head!r} (affine or turbo)")
        pick = calib.recommendation(base)
        if spec == "auto":
            if pick is None:
                raise AccelError(f"{flag}: the calibration found no level count without detectable loss"
                                 f"{' for ' + base if base else ''}; give LLO/LHI@FRAC explicitly")
            lo, hi, frac = pick["levels"][0], pick["levels"][1], pick["frac"]
            base = pick["base"]
        else:
            lo, hi, frac = _parse_levels(spec)
            base = base or (pick["base"] if pick else "turbo")
        indicator = calib.indicator
        params = make_params(base, (lo, hi), frac, indicator, ctx.seed, ctx.config, **calib.options(base))
        thresholds = calib.thresholds(indicator, frac)
        return StoredMap("kv", self.name, params, {**make_arrays(params, thresholds), **calib.means(base)})


class KVCalibration:
    """The read side of <calib>/kv: report.json and the per-layer score quantiles."""

    def __init__(self, path: Path, report: dict[str, Any], quantiles: dict[str, np.ndarray],
                 mean_arrays: dict[str, np.ndarray]):
        self.path, self.report, self.quantiles, self.mean_arrays = path, report, quantiles, mean_arrays

    @property
    def indicator(self) -> str:
        return self.report["runtime_indicator"]

    def recommendation(self, base: str | None) -> dict[str, Any] | None:
        recs = self.report.get("recommendations", {})
        if base is not None:
            return recs.get(base)
        found = [r for r in recs.values() if r is not None]
        return min(found, key=lambda r: r["bits_per_value"]) if found else None

    def options(self, base: str) -> dict[str, int]:
        return dict(self.report["options"][base])

    def thresholds(self, indicator: str, frac: float) -> np.ndarray:
        return quantile_threshold(self.quantiles[indicator], frac)

    def means(self, base: str) -> dict[str, np.ndarray]:
        """The channel means a base is centered with and the key scales it is smoothed with (empty: neither)."""
        out: dict[str, np.ndarray] = {}
        pre = bool(self.options(base).get("pre_rope", 0))
        if self.report.get("centered", {}).get(base):
            out["key_mean"] = self.mean_arrays["key_pre" if pre else "key"]
            out["value_mean"] = self.mean_arrays["value"]
        if self.report.get("smoothed", {}).get(base):
            out["key_scale"] = self.mean_arrays["key_scale_pre" if pre else "key_scale"]
        return out


def quantile_threshold(table: np.ndarray, frac: float) -> np.ndarray:
    """Per-layer threshold above which a fraction `frac` of the scores lie; table [layers, Q+1] holds quantile
    i/Q of each layer's scores (linear interpolation between them)."""
    q = table.shape[1] - 1
    if frac <= 0.0:
        return np.full(table.shape[0], np.finfo(np.float32).max, dtype=np.float32)
    if frac >= 1.0:
        return np.full(table.shape[0], -np.finfo(np.float32).max, dtype=np.float32)
    pos = (1.0 - frac) * q
    i = int(np.floor(pos))
    w = pos - i
    return (table[:, i] * (1 - w) + table[:, min(i + 1, q)] * w).astype(np.float32)


def _kv_report_problem(report: Any) -> str | None:
    """What makes a KV calibration report unusable (None: the fields KVCalibration reads are well formed)."""
    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def is_num(v: Any) -> bool:
        return (is_int(v) or isinstance(v, float)) and math.isfinite(v)

    if not isinstance(report, dict):
        return "not a JSON object"
    shape = report.get("model_shape")
    if not (isinstance(shape, list) and len(shape) == 3 and all(is_int(v) and v > 0 for v in shape)):
        return "model_shape is not three sizes"
    if report.get("runtime_indicator") not in RUNTIME_INDICATORS:
        return f"runtime_indicator is not one of {', '.join(RUNTIME_INDICATORS)}"
    recs, options = report.get("recommendations", {}), report.get("options")
    if not isinstance(recs, dict) or not isinstance(options, dict) or set(recs) - {"affine", "turbo"}:
        return "recommendations or options is not an object of the two bases"
    for key in ("centered", "smoothed"):
        if not isinstance(report.get(key, {}), dict):
            return f"{key} is not an object"
    for base in ("affine", "turbo"):
        opts = options.get(base)
        if not isinstance(opts, dict) or not all(isinstance(k, str) and is_int(v) for k, v in opts.items()):
            return f"options.{base} is not an object of integers"
        rec = recs.get(base)
        if rec is None:
            continue
        if not isinstance(rec, dict):
            return f"recommendations.{base} is not an object"
        try:  # the maps' own rule for level counts
            lo, hi = _check_levels(rec.get("levels"))
        except AccelError as exc:
            return f"recommendations.{base}: {exc}"
        if lo > hi:
            return f"recommendations.{base}.levels are not low first"
        if not (is_num(rec.get("frac")) and is_num(rec.get("bits_per_value")) and rec.get("base") in BASES):
            return f"recommendations.{base} lacks frac, bits_per_value or base"
    return None


def load_kv_calibration(calib: Path, config: dict[str, Any]) -> KVCalibration:
    from accel.formats.artifact import Artifact

    shape = model_kv_shape(config)  # a hybrid model is refused for what it is, before the calibration is read
    path = Path(calib) / KV_CALIB_DIR
    report_path = path / "report.json"
    if not report_path.is_file():
        raise AccelError(f"--calib {calib}: no KV calibration (run `accel calibrate MODEL --for kv` first)")
    try:
        report = jsontext.loads(report_path.read_text())
    except ValueError:
        raise AccelError(f"--calib {calib}: {report_path.name} is not JSON") from None
    problem = _kv_report_problem(report)
    if problem:
        raise AccelError(f"--calib {calib}: kv/{report_path.name} is damaged ({problem}); calibrate again")
    if tuple(report["model_shape"]) != shape:
        raise AccelError(f"--calib {calib}: the KV calibration is for {report.get('model_shape')} (layers, KV heads, "
                         f"head dim), the model has {list(shape)}: calibrated on a different model")
    try:
        art = Artifact(path)
        quantiles = {ind: art.decode(f"quantiles.{ind}").astype(np.float64) for ind in RUNTIME_INDICATORS}
        means = {name: art.decode(f"mean.{name}") for name in ("key", "value")}
        for name in ("key_pre", "key_scale", "key_scale_pre"):  # absent from older calibrations
            if f"mean.{name}" in art.names:
                means[name] = art.decode(f"mean.{name}")
    except (KeyError, FormatError) as exc:
        raise AccelError(f"--calib {calib}: the KV calibration's arrays are unreadable ({exc})") from None
    return KVCalibration(path, report, quantiles, means)
