"""Wan in the planner's catalog: counted from the real configs on the meta device, with their frozen encoders and a video trace."""

from __future__ import annotations

import pytest

from zeropipe.plan.model_spec import catalog_names, spec_from_catalog


@pytest.mark.parametrize(
    "name,params",
    # The released bf16 transformers: 2.84 GB (1.3B) and 28.6 GB (14B; each Wan 2.2 A14B expert has the 14B's config).
    [("wan2.1-t2v-1.3b", 1.42e9), ("wan2.1-t2v-14b", 14.29e9), ("wan2.2-t2v-a14b", 14.29e9)],
)
def test_wan_entries_count_their_transformer_umt5_and_vae(name, params, spec_of):
    assert name in catalog_names()
    spec = spec_of(name)
    assert spec.total_params == pytest.approx(params, rel=0.005) and spec.family == "diffusion_transformer"
    frozen = {model.name.split(" ")[0]: model.params for model in spec.frozen_models}
    assert frozen["text_encoder"] == pytest.approx(5.68e9, rel=0.01)  # UMT5-XXL's encoder: about 11 GB in bf16
    assert frozen["vae"] == pytest.approx(126.9e6, rel=0.01)
    trace = spec.activation_trace
    assert trace is not None and trace.frames == 81 and trace.resolution == 640
    assert trace.checkpointed_bytes < trace.saved_bytes / 10
