"""LTX-2 in the planner's catalog: its audio-video transformer counted from the real config, against Lightricks' published 19B.

Counted on the meta device component by component (the whole spec with its 121-frame trace is what
`zeropipe plan --model ltx-2` prints; it takes longer than this test should).
"""

from __future__ import annotations

import json

import pytest

from zeropipe.plan.model_spec import CATALOG_DIR, _build_component, catalog_names


def test_ltx2_counts_its_19b_audio_video_transformer_and_gemma3():
    assert "ltx-2" in catalog_names()
    entry = json.loads((CATALOG_DIR / "ltx-2.json").read_text())
    assert entry["architecture"] == "ltx2"
    transformer = _build_component(entry["trained"])
    total = sum(p.numel() for p in transformer.parameters())
    audio = sum(p.numel() for name, p in transformer.named_parameters() if "audio" in name)
    assert total == pytest.approx(18.88e9, rel=0.002) and total == pytest.approx(entry["published_params"], rel=0.01)
    assert audio == pytest.approx(5.71e9, rel=0.01)  # Lightricks: "about 5B" in the audio stream
    gemma = _build_component(entry["frozen"][0])
    assert sum(p.numel() for p in gemma.parameters()) == pytest.approx(12.2e9, rel=0.01)  # Gemma 3 12B with its vision tower


def test_ltx2_3_counts_its_transformer_and_text_connectors_against_the_published_22b():
    """LTX-2.3 (diffusers' converter, version "2.3"): the same classes; "22B" is the transformer and its 8-layer text connectors."""
    import torch
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    entry = json.loads((CATALOG_DIR / "ltx-2.3.json").read_text())
    assert "ltx-2.3" in catalog_names() and entry["architecture"] == "ltx2"
    transformer = sum(p.numel() for p in _build_component(entry["trained"]).parameters())
    with torch.device("meta"):
        connectors = LTX2TextConnectors(
            caption_channels=3840, text_proj_in_factor=49, video_connector_num_attention_heads=32, video_connector_attention_head_dim=128,
            video_connector_num_layers=8, video_connector_num_learnable_registers=128, video_gated_attn=True, audio_connector_num_attention_heads=32,
            audio_connector_attention_head_dim=64, audio_connector_num_layers=8, audio_connector_num_learnable_registers=128, audio_gated_attn=True,
            connector_rope_base_seq_len=4096, rope_type="split", per_modality_projections=True, video_hidden_dim=4096, audio_hidden_dim=2048, proj_bias=True,
        )
    text_connectors = sum(p.numel() for p in connectors.parameters())
    assert transformer == pytest.approx(18.99e9, rel=0.002) and text_connectors == pytest.approx(3.17e9, rel=0.01)
    assert transformer + text_connectors == pytest.approx(entry["published_params"], rel=0.01)
