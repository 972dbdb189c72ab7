"""LTX-2.5 in the planner's catalog: its transformer counted from diffusers' converter config for version "2.5", listed by the planner."""

from __future__ import annotations

import json

import pytest

from zeropipe.plan.model_spec import CATALOG_DIR, _build_component, catalog_names


def test_ltx25_counts_ltx2_3s_transformer_with_25s_deltas_and_names_its_entry():
    assert "ltx-2.5" in catalog_names()
    entry = json.loads((CATALOG_DIR / "ltx-2.5.json").read_text())
    assert entry["architecture"] == "ltx-2.5" and entry["published_params"] == 22e9
    transformer = _build_component(entry["trained"])
    assert transformer.config.ff_bias is False and transformer.keyframes_abs_pos_embedding.shape == (1, 4096)
    assert transformer.transformer_blocks[0].ff.net[2].bias is None and transformer.transformer_blocks[0].audio_ff.net[2].bias is not None
    total = sum(p.numel() for p in transformer.parameters())
    audio = sum(p.numel() for name, p in transformer.named_parameters() if "audio" in name)
    # LTX-2.3's 18.99B, less the video feed-forward's biases, plus the keyframe embedding; the published 22B adds the text connectors.
    assert total == pytest.approx(18.99e9, rel=0.002) and audio == pytest.approx(5.74e9, rel=0.01)
    assert [component["name"] for component in entry["frozen"]] == ["vae"]
