"""Entry point: builds the typer app and turns project exceptions into one line and an exit code."""

from __future__ import annotations

import os
import signal
import sys

import click
import typer
from rich.markup import escape

from accel import __version__
from accel.cli import (
    calibrate,
    eval_cmd,
    export_ane,
    generate_cmd,
    inspect_cmd,
    models,
    probe,
    quantize,
    verify,
)
from accel.cli.common import SIGTERM_SEEN, OutputClosed, Terminated, emit_json, stderr
from accel.errors import AccelError, CheckFailed

app = typer.Typer(
    name="accel",
    help="Offline model conversion for LLMs: calibrate, quantize (Leech lattice, SemKV, DAMP), export to the ANE, "
    "and inspect, verify and evaluate the results.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        print(f"accel {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    pass


for module in (models, calibrate, quantize, export_ane, inspect_cmd, verify, eval_cmd, generate_cmd):
    module.register(app)
app.add_typer(probe.app, name="probe")


def _click_classes(name: str) -> tuple[type[BaseException], ...]:
    """The exception class `name` from click and from the click that newer typer releases carry inside (typer 0.2x
    raises typer._click's and typer.exceptions' classes, which are not click's)."""
    found = [getattr(click.exceptions, name)]
    for module in ("typer._click.exceptions", "typer.exceptions"):
        try:
            cls = getattr(__import__(module, fromlist=[name]), name, None)
        except ImportError:
            cls = None
        if isinstance(cls, type) and cls not in found:
            found.append(cls)
    return tuple(found)


_EXIT, _ABORT, _USAGE = _click_classes("Exit"), _click_classes("Abort"), _click_classes("ClickException")


def main(argv: list[str] | None = None) -> int:
    SIGTERM_SEEN["seen"] = False
    code = _dispatch(sys.argv[1:] if argv is None else argv)
    if SIGTERM_SEEN["seen"]:  # typer turns the interrupt into a plain return of 130
        stderr.print("terminated")
        return 143
    return code


def _dispatch(argv: list[str]) -> int:
    want_json = "--json" in argv
    try:
        result = app(args=argv, prog_name="accel", standalone_mode=False)
        return result if isinstance(result, int) else 0
    except _EXIT as exc:
        return getattr(exc, "exit_code", 0)
    except _ABORT:
        stderr.print("aborted")
        return 130
    except _USAGE as exc:  # usage errors: bad option, missing argument
        message = exc.format_message()
        if want_json:
            emit_json({"ok": False, "error": message})
        stderr.print(f"[bold red]error:[/] {escape(message)}{escape(_help_hint(exc))}", soft_wrap=True, markup=True)
        return 2
    except OutputClosed:  # whoever read stdout stopped (`| head`): quietly, as a tool that SIGPIPE stopped
        _discard_stdout()
        return 128 + signal.SIGPIPE
    except OSError as exc:  # the system refused a read or write (permissions, a full disk, a special file)
        where = f": {exc.filename}" if exc.filename else ""
        message = f"{exc.strerror or exc}{where}"
        if want_json:
            emit_json({"ok": False, "error": message})
        stderr.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True, markup=True)
        return 2
    except AccelError as exc:
        message = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        if want_json:
            emit_json({"ok": False, "error": message})
        stderr.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True, markup=True)
        return 2
    except CheckFailed as exc:
        if str(exc):
            stderr.print(f"[bold red]failed:[/] {escape(str(exc))}", soft_wrap=True, markup=True)
        return 1
    except KeyboardInterrupt:  # SIGTERM included (main reports it)
        if not SIGTERM_SEEN["seen"]:
            stderr.print("interrupted")
        return 130


def _help_hint(exc: BaseException) -> str:
    """' (see accel quantize -h)' for a usage error raised inside a command; click prints the command's usage
    line and a 'Try ... for help' line around the message, which makes a four-line error of one mistake."""
    ctx = getattr(exc, "ctx", None)
    path = getattr(ctx, "command_path", "") if ctx is not None else ""
    return f" (see {path} -h)" if path else ""


def _discard_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's last flush does not fail on the closed pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is not a file descriptor (a test's capture): nothing to flush there
        pass


def _on_sigterm(signum: int, frame: object) -> None:
    SIGTERM_SEEN["seen"] = True
    raise Terminated()


def run() -> None:
    # transformers' notes (pure-PyTorch fallbacks for GDN/KDA kernels, deprecations) are not the user's concern
    # here; TRANSFORMERS_VERBOSITY=warning brings them back
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    signal.signal(signal.SIGTERM, _on_sigterm)
    sys.exit(main())
