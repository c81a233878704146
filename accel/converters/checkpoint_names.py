"""Checkpoint names to model names: the renames and merges transformers applies when it loads a checkpoint.

transformers 5 builds some architectures with parameters that their published checkpoints do not have: a
mixture-of-experts layer holds every expert's gate and up projections in one `experts.gate_up_proj` tensor and
their down projections in `experts.down_proj` (Mixtral, Qwen2/3-MoE, Qwen3-Next, DeepSeek-V3, Kimi-Linear, ...),
while the checkpoints store `experts.<i>.gate_proj.weight` (or `w1`, `w3`, `w2`) one expert at a time; Kimi-Linear
also moves its gate parameters under `forget_gate.` and joins three convolutions into one. `from_pretrained`
applies a conversion mapping (`transformers.conversion_mapping`) on the way in, and `save_pretrained` reverses it,
so the files on disk keep the checkpoint's names.

accel keeps those names in everything it writes (a quantized output has the tensors its source had, so `verify
--reference` pairs them by name) and converts only where a model is built: this module reads transformers' mapping
for the model type and applies its renames (a regular expression on the name) and merges (stack the experts in
index order along a new first axis, then concatenate the sources along an axis). A mapping with an operation this
module does not implement is refused when a checkpoint name matches it, rather than guessed at. Names that match no
rule pass unchanged, so a checkpoint already in the model's names (accel's own fixtures) loads as it is.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np

from accel.errors import AccelError


@dataclass(frozen=True)
class _Rename:
    pattern: re.Pattern[str]
    replacement: str


@dataclass(frozen=True)
class _Merge:
    sources: tuple[re.Pattern[str], ...]  # one per source pattern; a '*' (the expert index) is the group (\d+)
    target: str  # appended to the name's part before the match
    stack: bool  # MergeModulelist(dim=0): each source's experts stacked in index order
    concat_dim: int | None  # Concatenate(dim): the sources joined along this axis
    unsupported: str | None = None  # an operation this module does not implement


@dataclass
class NameMap:
    """How a checkpoint's names become a model's: `renamed` maps a name to its model name (itself when no rule
    applies); `merged` maps a model name to the checkpoint names it is built from, one list per source pattern."""

    renamed: dict[str, str] = field(default_factory=dict)
    merged: dict[str, tuple[_Merge, list[list[str]]]] = field(default_factory=dict)
    experts: dict[str, tuple[str, int]] = field(default_factory=dict)  # name -> (merged parameter, expert index)

    def model_name(self, name: str) -> str | None:
        """The model's name for a checkpoint name that maps one to one; None for a part of a merged tensor."""
        return self.renamed.get(name)

    def expert_of(self, name: str) -> tuple[str, int] | None:
        """(the merged parameter, the expert's index in it) for a checkpoint name that is one expert's projection
        (a merge that stacks experts); None otherwise."""
        return self.experts.get(name)


def _source_regex(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern.replace("*", r"(\d+)") + "$")


@cache
def _rules(model_type: str) -> tuple[tuple[_Rename | _Merge, ...], ...]:
    """transformers' conversion mapping for the model type as (renames, merges); none for most architectures."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # a transformers without conversion mappings loads checkpoints as they are
        return (), ()
    renames: list[_Rename] = []
    merges: list[_Merge] = []
    for rule in get_checkpoint_conversion_mapping(model_type) or []:
        if isinstance(rule, WeightRenaming):
            for source, target in zip(rule.source_patterns, rule.target_patterns, strict=True):
                renames.append(_Rename(re.compile(source), target.replace("\\", "")))
        elif isinstance(rule, WeightConverter):
            ops = [(type(op).__name__, getattr(op, "dim", None)) for op in rule.operations]
            kinds = [kind for kind, _ in ops]
            unsupported = None
            if len(rule.target_patterns) != 1 or not set(kinds) <= {"MergeModulelist", "Concatenate"} \
                    or ("MergeModulelist", 0) not in ops and "MergeModulelist" in kinds:
                unsupported = f"{', '.join(kinds) or 'no operation'} into {rule.target_patterns}"
            concat = [dim for kind, dim in ops if kind == "Concatenate"]
            merges.append(_Merge(tuple(_source_regex(p) for p in rule.source_patterns),
                                 rule.target_patterns[0].replace("\\", ""), "MergeModulelist" in kinds,
                                 concat[0] if concat else None, unsupported))
    return tuple(renames), tuple(merges)


def name_map(model_type: str, names: list[str] | Mapping[str, Any]) -> NameMap:
    """The renames and merges of `model_type` applied to these checkpoint names (see the module docstring)."""
    renames, merges = _rules(model_type)
    result = NameMap()
    groups: dict[str, tuple[_Merge, dict[int, dict[int, str]]]] = {}
    for name in names:
        renamed = name
        for rule in renames:
            renamed = rule.pattern.sub(rule.replacement, renamed)
        for merge in merges:
            found = [(i, m) for i, regex in enumerate(merge.sources) if (m := regex.search(renamed))]
            if not found:
                continue
            if merge.unsupported:
                raise AccelError(f"tensor {name!r}: this {model_type} checkpoint stores it in a layout transformers "
                                 f"converts with {merge.unsupported}, which accel does not implement")
            source, match = found[0]
            target = renamed[: match.start()] + merge.target
            index = int(match.group(1)) if merge.stack else 0
            slots = groups.setdefault(target, (merge, {}))[1].setdefault(source, {})
            if index in slots:
                raise AccelError(f"tensors {slots[index]!r} and {name!r} both make part {index} of {target!r}")
            slots[index] = name
            break
        else:
            result.renamed[name] = renamed
    for target, (merge, slots) in groups.items():
        if sorted(slots) != list(range(len(merge.sources))):
            raise AccelError(f"{target!r} is made of {len(merge.sources)} kinds of tensor and the checkpoint has "
                             f"{len(slots)} of them (missing tensors)")
        ordered = []
        for source in range(len(merge.sources)):
            indices = sorted(slots[source])
            if indices != list(range(len(indices))):
                raise AccelError(f"{target!r}: the checkpoint's experts are numbered {indices[:8]}..., not 0 to "
                                 f"{len(indices) - 1}")
            ordered.append([slots[source][i] for i in indices])
        result.merged[target] = (merge, ordered)
        if merge.stack:
            result.experts.update({name: (target, i) for source in ordered for i, name in enumerate(source)})
    _refuse_collisions(model_type, result)
    return result


def _refuse_collisions(model_type: str, names: NameMap) -> None:
    """Two checkpoint tensors that would become one parameter (a tensor under both its checkpoint and its model
    name, a merged parameter also stored whole): refused, as transformers would silently keep one of them."""
    seen: dict[str, str] = {}
    for name, model in names.renamed.items():
        if model in seen:
            raise AccelError(f"tensors {seen[model]!r} and {name!r} are both {model!r} in a {model_type} model "
                             f"(the checkpoint holds it twice)")
        seen[model] = name
    for target, (_, ordered) in names.merged.items():
        if target in seen:
            raise AccelError(f"tensor {seen[target]!r} and the checkpoint's {ordered[0][0]!r}... both make "
                             f"{target!r} (the checkpoint holds it twice)")


def _merged_shape(merge: _Merge, shapes: list[list[tuple[int, ...]]], target: str) -> tuple[int, ...]:
    parts = []
    for source in shapes:
        if any(s != source[0] for s in source):
            raise AccelError(f"{target!r}: its experts differ in shape ({source[0]} and others)")
        parts.append(((len(source),) if merge.stack else ()) + tuple(source[0]))
    if len(parts) == 1:
        return parts[0]
    dim = merge.concat_dim if merge.concat_dim is not None else 0
    rest = [p[:dim] + p[dim + 1:] for p in parts]
    if any(r != rest[0] for r in rest):
        raise AccelError(f"{target!r}: its parts cannot be joined along axis {dim} (shapes {parts})")
    return parts[0][:dim] + (sum(p[dim] for p in parts),) + parts[0][dim + 1:]


def to_model_shapes(model_type: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Checkpoint shapes by model name (what the model will be given)."""
    names = name_map(model_type, list(shapes))
    out = {model: tuple(shapes[name]) for name, model in names.renamed.items()}
    for target, (merge, ordered) in names.merged.items():
        out[target] = _merged_shape(merge, [[tuple(shapes[n]) for n in source] for source in ordered], target)
    return out


def to_model_tensors(model_type: str, tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Checkpoint tensors by model name, merged tensors built (float32 when merged; others passed as given)."""
    names = name_map(model_type, list(tensors))
    out = {model: tensors[name] for name, model in names.renamed.items()}
    for target, (merge, ordered) in names.merged.items():
        _merged_shape(merge, [[tuple(np.shape(tensors[n])) for n in source] for source in ordered], target)
        parts = []
        for source in ordered:
            arrays = [_float32(tensors[n]) for n in source]
            parts.append(np.stack(arrays) if merge.stack else arrays[0])
        dim = merge.concat_dim if merge.concat_dim is not None else 0
        out[target] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=dim)
    return out


def _float32(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().to("cpu").float().numpy()
    return np.asarray(value, dtype=np.float32)
