"""LTX-2 in the planner's catalog: its audio-video transformer counted from the real config, against Lightricks' published 19B."""

from __future__ import annotations

import pytest

from zeropipe.plan.model_spec import catalog_names


def test_ltx2_counts_its_19b_audio_video_transformer_gemma3_and_traces_both_streams(spec_of):
    assert "ltx-2" in catalog_names()
    spec = spec_of("ltx-2")
    assert spec.total_params == pytest.approx(18.88e9, rel=0.002) and spec.total_params == pytest.approx(spec.published_params, rel=0.01)
    frozen = {model.name.split(" ")[0]: model.params for model in spec.frozen_models}
    assert frozen["text_encoder"] == pytest.approx(12.2e9, rel=0.01)  # Gemma 3 12B with its vision tower
    trace = spec.activation_trace
    assert trace is not None and trace.frames == 121 and trace.resolution == 512
