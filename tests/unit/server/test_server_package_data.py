"""Every file the UI serves ships in the wheel: a new asset type must be added to package-data."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

import zeropipe.server

ROOT = Path(__file__).resolve().parents[3]


def test_static_files_and_templates_are_package_data():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["zeropipe.server"]
    server = Path(zeropipe.server.__file__).parent
    files = [p.relative_to(server).as_posix() for folder in ("static", "templates") for p in (server / folder).rglob("*") if p.is_file()]
    assert "static/vendor/uPlot.iife.min.js" in files and "templates/base.html" in files
    missing = [f for f in files if not any(fnmatch.fnmatch(f, pattern) for pattern in patterns)]
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"


def test_vendored_libraries_carry_their_license_and_are_listed_in_the_docs():
    vendor = Path(zeropipe.server.__file__).parent / "static" / "vendor"
    docs = (ROOT / "docs" / "ui.md").read_text()
    for library, version in (("uPlot", "1.6.32"), ("js-yaml", "5.5.0")):
        assert (vendor / f"{library}.LICENSE").read_text().startswith(("The MIT License", "(The MIT License)"))
        assert f"| {version} | MIT" in docs


def test_swagger_ui_is_vendored_with_its_license():
    vendor = Path(zeropipe.server.__file__).parent / "static" / "vendor"
    assert (vendor / "swagger-ui.LICENSE").read_text().lstrip().startswith("Apache License")
    assert (vendor / "swagger-ui-bundle.js").stat().st_size > 1_000_000 and (vendor / "swagger-ui.css").is_file()
    assert "| 5.35.0 | Apache-2.0" in (ROOT / "docs" / "ui.md").read_text()
