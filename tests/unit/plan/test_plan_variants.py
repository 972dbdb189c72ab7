"""The model-level knobs: activations scaled to another shape bound a fresh trace from above; stored traces are the traces."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest

from zeropipe.plan.variants import Shape, catalog_match, with_caches, with_shape

ROOT = Path(__file__).resolve().parents[3]


@functools.cache
def tiny_wan(resolution: int, frames: int):
    from zeropipe.config.load import load_config
    from zeropipe.families import model_spec

    config = load_config(ROOT / "examples/video-quickstart.yaml", [f"data.images.resolution={resolution}", f"data.video.frame_buckets=[1,{frames}]"])
    return model_spec(config)


@pytest.mark.parametrize("source,target", [((64, 9), (32, 9)), ((32, 9), (64, 9)), ((64, 9), (64, 5)), ((64, 9), (96, 13))])
def test_scaled_activations_are_an_upper_bound_of_a_fresh_trace(source, target):
    scaled = with_shape(tiny_wan(*source), Shape(*target)).activation_trace
    traced = tiny_wan(*target).activation_trace
    for name in ("saved_bytes", "checkpointed_bytes", "largest_block_bytes"):
        assert getattr(traced, name) <= getattr(scaled, name) <= 3 * getattr(traced, name), name


def test_caching_moves_every_encoder_off_the_ranks_and_back():
    spec = tiny_wan(32, 9)
    uncached = with_caches(spec, latents=False, text=False)
    assert {m.name for m in uncached.frozen_models} == {m.name for m in spec.cached_models} and not uncached.cached_models
    cached = with_caches(uncached)
    assert not cached.frozen_models and {m.name for m in cached.cached_models} == {m.name for m in spec.cached_models}


@pytest.mark.parametrize(
    "path,entry",
    [
        ("/models/FLUX.2-dev", "flux.2-dev"),
        ("black-forest-labs/FLUX.2-dev", "flux.2-dev"),
        ("/models/Wan2.1-T2V-14B-Diffusers", "wan2.1-t2v-14b"),
        ("/data/qwen-image", "qwen-image"),
        ("/models/HunyuanVideo-1.5", "hunyuan-video-1.5"),  # the catalog name, without punctuation
        ("/models/Krea-2-Raw-Diffusers", "krea-2"),  # the Hub repository krea/Krea-2-Raw, without "-Diffusers"
        ("/models/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers", "kandinsky5-t2v-lite"),
        ("/models/my-own-finetune", None),
    ],
)
def test_a_model_path_names_a_catalog_entry_by_its_hub_repository(path, entry):
    assert catalog_match(path) == entry


def test_a_stored_trace_is_the_trace(tmp_path, monkeypatch):
    """Record the tiny Wan's trace into a fresh store, then build it again: the stored one comes back, equal to the traced one."""
    from zeropipe.plan import trace_store

    monkeypatch.setattr(trace_store, "STORE", tmp_path / "traces.json")
    trace_store._stored.cache_clear()
    monkeypatch.setitem(trace_store.RECORDING, "on", "1")
    tiny_wan.cache_clear()
    traced = tiny_wan(48, 9).activation_trace
    assert (tmp_path / "traces.json").is_file()
    monkeypatch.delitem(trace_store.RECORDING, "on")
    tiny_wan.cache_clear()
    calls = []
    monkeypatch.setattr("zeropipe.families.diffusion.plan_specs.trace_diffusion", lambda *a, **k: calls.append(a))
    stored = tiny_wan(48, 9).activation_trace
    assert not calls and dataclasses.asdict(stored) == dataclasses.asdict(traced)
    trace_store._stored.cache_clear()
    tiny_wan.cache_clear()
