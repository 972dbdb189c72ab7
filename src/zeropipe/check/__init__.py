"""`zeropipe check`: refuse what cannot work before any process starts."""

from zeropipe.check.run import CheckFailed, check_config

__all__ = ["CheckFailed", "check_config"]
