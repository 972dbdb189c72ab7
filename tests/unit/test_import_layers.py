"""The package's layers hold: no module imports from a layer above its own, and no import circles.

The contracts are in pyproject.toml ([tool.importlinter]); function-level imports count.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "zeropipe"


def test_import_contracts_hold(capsys):
    # A test dependency (pyproject's [test] extra): the contract must run, never skip.
    import importlinter.cli as importlinter_cli

    code = importlinter_cli.lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    assert code == 0, capsys.readouterr().out


def family_and_architecture_comparisons() -> list[str]:
    """Comparisons of a name against a family's or a diffusion architecture's literal name, outside their own modules."""
    names = {"causal_lm", "vlm", "diffusion", "sdxl", "sd15", "sd3", "flux", "wan"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("families/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                literals = [c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant) and isinstance(c.value, str)]
                literals += [e.value for c in node.comparators if isinstance(c, (ast.Tuple, ast.List, ast.Set)) for e in c.elts if isinstance(e, ast.Constant)]
                if names & set(literals):
                    found.append(f"{relative}:{node.lineno}")
    return found


# The comparisons left, each with its reason:
ALLOWED = {
    # A planner catalog entry says which shape of model it describes (causal_lm, diffusion_unet...).
    "plan/model_spec.py",
}


def test_family_names_are_compared_only_in_the_family_modules():
    found = family_and_architecture_comparisons()
    assert {place.split(":")[0] for place in found} <= ALLOWED and len(found) <= len(ALLOWED), found
