"""No module under src/ is over 800 lines: a longer one is split along its own seams (issue #39)."""

from __future__ import annotations

from pathlib import Path

import zeropipe

MAX_LINES = 800
SRC = Path(zeropipe.__file__).resolve().parent


def test_no_module_is_over_800_lines():
    lengths = {path.relative_to(SRC.parent).as_posix(): len(path.read_text(encoding="utf-8").splitlines()) for path in SRC.rglob("*.py")}
    assert len(lengths) > 100, f"found only {len(lengths)} modules under {SRC}"
    too_long = {name: count for name, count in sorted(lengths.items()) if count > MAX_LINES}
    assert not too_long, f"modules over {MAX_LINES} lines (split each along its own seams): {too_long}"
