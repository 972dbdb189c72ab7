"""Warnings that say nothing about the run, kept out of rank logs and out of the diagnosis's log tail."""

from __future__ import annotations

import warnings

# Third-party deprecation notices that say nothing about this run: torch's gloo wrappers warn
# on every collective DeepSpeed makes (168 of 429 lines of a ZeRO-3 rank log after 5 steps).
# The pattern also serves launch.diagnose, which drops them from the log tail it shows.
KNOWN_NOISE = [
    r"`?torch\.distributed\.\w+`? is deprecated",
]


def quiet_known_noise() -> None:
    for pattern in KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=f".*{pattern}", category=FutureWarning)
