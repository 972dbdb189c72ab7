"""Specs are built on the meta device once per session: diffusion ones trace a forward pass (seconds)."""

from __future__ import annotations

import functools

import pytest

import zeropipe.families.diffusion  # noqa: F401 - registers the diffusion family's spec builders with the planner


@functools.cache
def catalog_spec(name: str, lora_r: int | None = None):
    from zeropipe.config.schema import LoraSection
    from zeropipe.plan.model_spec import spec_from_catalog

    return spec_from_catalog(name, LoraSection(r=lora_r) if lora_r else None)


@pytest.fixture(scope="session")
def spec_of():
    return catalog_spec
