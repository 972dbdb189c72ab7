"""Exceptions that the CLI and the web layer turn into messages.

Library code raises these and never prints or exits; each message says what is wrong
and how to fix it.
"""

from __future__ import annotations


class ZeroPipeError(Exception):
    """Base class: an error with a message meant for the user."""


class ConfigError(ZeroPipeError):
    """One or more problems in a run config, reported together.

    Args:
        problems: ``(key, message)`` pairs, each naming the dotted key and the fix.
    """

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        lines = [f"{len(self.problems)} problem(s){where}:"]
        lines += [f"  - {key}: {message}" if key else f"  - {message}" for key, message in self.problems]
        super().__init__("\n".join(lines))


class DataError(ZeroPipeError):
    """The training data cannot be used (missing file, too many malformed records...)."""


class CheckpointError(ZeroPipeError):
    """A checkpoint is missing, incomplete or does not match the run."""


class LaunchError(ZeroPipeError):
    """The ranks could not be started or one of them failed; the message is the diagnosis."""
