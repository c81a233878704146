"""Progress reporting that the library calls and the CLI renders (rich bars on stderr)."""

from __future__ import annotations


class Progress:
    """Silent progress; the CLI passes a subclass that draws bars. Stages run one after another."""

    def stage(self, description: str, total: int) -> None:
        """Begin a stage of `total` steps."""

    def advance(self, steps: int = 1) -> None:
        """Mark steps of the current stage done."""

    def close(self) -> None:
        """End the last stage."""


SILENT = Progress()
