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
