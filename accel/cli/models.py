"""`accel models`: the built-in aliases and where they resolve."""

from __future__ import annotations

import typer
from rich.table import Table
from rich.text import Text

from accel.cli.common import JSON_OPTION, emit_json, stdout


def register(app: typer.Typer) -> None:
    @app.command()
    def models(json_out: bool = JSON_OPTION) -> None:
        """List the built-in model aliases and where each resolves on this machine."""
        from accel.converters.aliases import alias_table

        rows = [{"alias": a.name, "description": a.description, "path": str(a.path) if a.path else None,
                 "problem": a.problem} for a in alias_table()]
        if json_out:
            emit_json({"models": rows})
            return
        table = Table("alias", "description", "resolves to")
        for row in rows:
            table.add_row(row["alias"], row["description"], row["path"] or Text(str(row["problem"]), style="dim"))
        stdout.print(table)
