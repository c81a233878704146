"""The project's exception types; the CLI maps them to one line and an exit code."""


class AccelError(Exception):
    """Bad input or usage: the message is one line for the user; the CLI exits 2."""


class FormatError(AccelError):
    """A file accel reads is corrupt, truncated, hostile or from an unknown version."""


class NotAccelOutput(FormatError):
    """The path is no accel output at all (another kind of file or directory), as opposed to a damaged one: for
    `verify` bad input (exit 2), not a fault."""


class CheckFailed(Exception):
    """A check or quality gate failed (verify found a fault): the CLI exits 1."""
