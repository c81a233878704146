"""Entry point: builds the typer app and turns project exceptions into one line and an exit code."""

from __future__ import annotations

import os
import re
import shutil
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
from accel.cli.common import SIGTERM_SEEN, BarProgress, OutputClosed, Terminated, emit_json, stderr
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
    argv = sys.argv[1:] if argv is None else argv
    try:
        code = _dispatch(argv)
        if SIGTERM_SEEN["seen"] and code != 143:  # SIGTERM where nothing turned it into an interrupt
            stderr.print("terminated")
            return 143
        return code
    except OutputClosed:  # stdout went away while an error was being reported on it
        _discard_stdout()
        return 128 + signal.SIGPIPE
    except OSError as exc:  # stdout refused the error report itself (a full disk, /dev/full): stderr alone
        stderr.print(f"[bold red]error:[/] {escape(_os_message(exc))}", soft_wrap=True, markup=True)
        return 2


def _dispatch(argv: list[str]) -> int:
    want_json = "--json" in argv

    def fail(message: str, code: int = 2, prefix: str = "error: ", hint: str = "") -> int:
        if want_json:
            emit_json({"ok": False, "error": message})
        stderr.print(f"[bold red]{escape(prefix)}[/]{escape(message + hint)}", soft_wrap=True, markup=True)
        return code

    try:
        try:
            result = app(args=argv, prog_name="accel", standalone_mode=False)
        finally:  # a bar left drawn by a command that stopped early would go on redrawing over what follows
            BarProgress.stop_all()
        if result == 130 or SIGTERM_SEEN["seen"]:  # typer turns Ctrl-C (and SIGTERM's Terminated) into a return
            return _interrupted(want_json)                  # of 130, which no command returns otherwise
        return result if isinstance(result, int) else 0
    except _EXIT as exc:
        return getattr(exc, "exit_code", 0)
    except _ABORT:
        return fail("aborted", 130, prefix="")
    except _USAGE as exc:  # usage errors: bad option, missing argument
        message = exc.format_message()
        if not message:  # no command given: click printed the help, which says it all
            return 2
        return fail(message, hint=_help_hint(exc))
    except OutputClosed:  # whoever read stdout stopped (`| head`): quietly, as a tool that SIGPIPE stopped
        _discard_stdout()
        return 128 + signal.SIGPIPE
    except OSError as exc:  # the system refused a read or write (permissions, a full disk, a special file)
        return fail(_os_message(exc))
    except AccelError as exc:
        return fail(str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__)
    except CheckFailed as exc:
        if str(exc):
            stderr.print(f"[bold red]failed:[/] {escape(str(exc))}", soft_wrap=True, markup=True)
        return 1
    except KeyboardInterrupt:  # raised outside typer's command call
        return _interrupted(want_json)


def _interrupted(want_json: bool) -> int:
    """Ctrl-C: 130, SIGTERM: 143, each with one line on stderr (and the error object under --json)."""
    terminated = SIGTERM_SEEN["seen"]
    message = "terminated" if terminated else "interrupted"
    if want_json:
        emit_json({"ok": False, "error": message})
    stderr.print(message)
    return 143 if terminated else 130


def _os_message(exc: OSError) -> str:
    """An OSError as one line: its reason and the file it names. shutil.copytree's Error carries a list of
    (source, destination, reason) for every file it failed on: the first, and how many more."""
    if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list) and exc.args[0]:
        failures = exc.args[0]
        first = failures[0]
        more = f" (and {len(failures) - 1} more files)" if len(failures) > 1 else ""
        if isinstance(first, tuple) and len(first) == 3:  # the reason is str() of an OSError: "[Errno 28] ...: ..."
            reason = re.match(r"(?:\[Errno \d+\] )?([^:]*)", str(first[2])).group(1) or str(first[2])
            return f"{reason}: {first[1]}{more}"
    where = f": {exc.filename}" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"


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
    # a stream whose encoding lacks a character the output uses (ΔNLL under PYTHONIOENCODING=latin-1) gets '?' in
    # its place rather than a UnicodeEncodeError in the middle of a report
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
    signal.signal(signal.SIGTERM, _on_sigterm)
    sys.exit(main())
