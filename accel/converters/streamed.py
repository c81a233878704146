"""A transformers model whose weights stay in the source until a part of it runs (design.md §8).

`StreamedModel` builds the model on the meta device from an open source, and `load(within)` reads only the
parameters whose names `within` accepts (a decoder layer's, say), converted to the model's names and float32 as
`build_transformers_model` would; `release(within)` puts them back on the meta device. What runs a model a layer at
a time (`accel calibrate --for weights`) then holds one layer's weights, not the model's.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from accel.converters.checkpoint_names import name_map, to_model_tensors
from accel.converters.materialize import assign_parameters, empty_model, parameter_groups, tensor_problems
from accel.converters.sources import ModelSource
from accel.errors import AccelError

Within = Callable[[str], bool]  # a model parameter name -> whether it is meant


class StreamedModel:
    """`model`, built from `source` (kept open by the caller) with its parameters on the meta device until loaded.

    The tensors are checked up front as `build_transformers_model` checks them (names and shapes, nothing read);
    a loaded tensor holding NaN or Inf is refused with `nonfinite_message` (its name in `{name}`) when that is set.
    """

    def __init__(self, source: ModelSource, nonfinite_message: str | None = None):
        self.source = source
        self.model_type = str(source.config.get("model_type"))
        self.nonfinite_message = nonfinite_message
        self.model = empty_model(source.config)
        shapes = source.tensor_shapes()
        problems = tensor_problems(self.model, shapes, self.model_type)
        if problems:
            raise AccelError(problems[0])
        names = name_map(self.model_type, list(shapes))
        self._parts: dict[str, list[str]] = {model: [name] for name, model in names.renamed.items()}
        for target, (_, ordered) in names.merged.items():
            self._parts[target] = [name for part in ordered for name in part]
        self._groups = sorted(parameter_groups(self.model).values())
        param_names = {name for names in self._groups for name in names}
        self._buffers = [n for n in self.model.state_dict(keep_vars=True) if n not in param_names and n in self._parts]
        self.model.config.dtype = torch.float32
        self.model.eval()

    def load(self, within: Within) -> None:
        """Read the parameters (and stored buffers) `within` accepts that are not loaded yet."""
        groups = [names for names in self._groups
                  if any(within(n) for n in names) and self._parameter(names[0]).device.type == "meta"]
        buffers = [n for n in self._buffers if within(n)]
        wanted = [part for names in groups for name in names for part in self._parts.get(name, [])]
        wanted += [part for name in buffers for part in self._parts[name]]
        checkpoint = {name: self._checked(name, self.source.load_tensor(name)) for name in dict.fromkeys(wanted)}
        tensors = to_model_tensors(self.model_type, checkpoint)
        del checkpoint
        assign_parameters(self.model, groups, tensors)
        for name in buffers:
            buffer = self.model.get_buffer(name)
            buffer.copy_(torch.from_numpy(np.asarray(tensors[name], dtype=np.float32)).to(buffer.dtype))

    def release(self, within: Within) -> None:
        """Put the parameters `within` accepts back on the meta device (their memory is freed)."""
        for names in self._groups:
            if any(within(n) for n in names):
                meta = torch.nn.Parameter(torch.empty(self._parameter(names[0]).shape, device="meta"),
                                          requires_grad=False)
                for name in names:
                    module_name, _, leaf = name.rpartition(".")
                    self.model.get_submodule(module_name)._parameters[leaf] = meta

    def loaded_bytes(self) -> int:
        """The bytes of the parameters loaded now."""
        return sum(p.nbytes for p in self.model.parameters() if p.device.type != "meta")

    def _parameter(self, name: str) -> torch.Tensor:
        return self.model.get_parameter(name)

    def _checked(self, name: str, array: np.ndarray) -> np.ndarray:
        if self.nonfinite_message is not None and not np.isfinite(array).all():
            raise AccelError(self.nonfinite_message.format(name=name))
        return array
