"""No entry module imports another entry module: what two entries share is a named piece beside them.

Shared pieces live in ``families/diffusion/bases/`` (a model line's classes and base record),
``parts/`` (latent codecs, conditions) and ``tiny/`` (the tiny presets' tokenizers and components).
Read from the source (every import statement, function-level ones included), so the test costs no model.
"""

from __future__ import annotations

import ast
from pathlib import Path

from zeropipe.families.diffusion import entries

ENTRIES_DIR = Path(entries.__file__).parent
PACKAGE = "zeropipe.families.diffusion.entries"


def imported_modules(path: Path) -> set[str]:
    """Every module an entry's source imports, as a dotted name (``from x import y`` gives x and x.y)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if node.level == 0 else f"{PACKAGE}.{node.module}"
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return found


def test_every_builtin_entry_is_a_module_of_the_entries_package():
    modules = {path.stem for path in ENTRIES_DIR.glob("*.py")} - {"__init__"}
    assert set(entries.BUILTIN) == modules, f"entries/ holds modules that are not entries, or an entry is missing: {sorted(modules ^ set(entries.BUILTIN))}"


def test_no_entry_imports_another_entry():
    names = {f"{PACKAGE}.{module}" for module in entries.BUILTIN}
    pairs = sorted(
        f"{module} imports {other.rsplit('.', 1)[-1]}"
        for module in entries.BUILTIN
        for other in imported_modules(ENTRIES_DIR / f"{module}.py") & names
        if other != f"{PACKAGE}.{module}"
    )
    assert not pairs, f"entries import other entries (move what they share to bases/, parts/ or tiny/): {pairs}"


def test_the_check_sees_an_entry_importing_another(tmp_path):
    """The reading above finds both import forms an entry could use (so the test above can fail)."""
    source = tmp_path / "probe.py"
    source.write_text(f"from {PACKAGE}.wan import ARCHITECTURE\n\ndef f():\n    from {PACKAGE} import flux\n")
    assert {f"{PACKAGE}.wan", f"{PACKAGE}.flux"} <= imported_modules(source)
