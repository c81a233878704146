"""The project's exception types; the CLI maps them to one line and an exit code."""


class AccelError(Exception):
    """Bad input or usage: the message is one line for the user; the CLI exits 2."""


class FormatError(AccelError):
    """A file accel reads is corrupt, truncated, hostile or from an unknown version."""


class CheckFailed(Exception):
    """A check or quality gate failed (verify found a fault): the CLI exits 1."""
