"""MiniMax-H3 in the planner's catalog: counted from its released transformer config on the meta device, and traced on one
clip's packed sequence (video rows, its soundtrack's audio rows, the prompt's rows) as the pipeline lays it out.

The catalog entry's "source" names the release and its revision; a trace at the catalog's size takes minutes on a CI core,
so the trace is checked on the tiny preset's transformer and the counts on the catalog's configs.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.plan.test_plan_kandinsky_krea_ernie_catalog import meta_count
from zeropipe.plan.model_spec import CATALOG_DIR, catalog_names

RELEASED_BYTES = 66_280_430_080  # the 14 safetensors shards of MiniMaxAI/MiniMax-H3's transformer (bf16, a few fp32 projections)


def test_the_catalog_entry_counts_the_released_transformer():
    assert "minimax-h3" in catalog_names()
    entry = json.loads((CATALOG_DIR / "minimax-h3.json").read_text())
    assert entry["architecture"] == "minimax-h3" and "48d93ede732756e404a3b1b2f3b3a9b5a22f6cfc" in entry["source"]
    count = meta_count(entry["trained"])
    assert count == pytest.approx(33.12e9, rel=0.001) and count == pytest.approx(RELEASED_BYTES / 2, rel=0.002)
    text = next(component for component in entry["frozen"] if component["name"].startswith("text_encoder"))["config"]["text_config"]
    # The pipeline reads hidden state 50 of the text encoder: its width is the transformer's text input, and it has more layers.
    assert entry["trained"]["config"]["text_dim"] == text["hidden_size"] and text["num_hidden_layers"] > 50


def test_the_trace_is_one_clips_packed_sequence_as_the_pipeline_aligns_it():
    """The planner counts 14 latent frames for 56 frames (a 4k+1 VAE's count); the trace turns them back into the clip, aligns it to
    17k+5 (56) and lays out 17 latent frames of video rows, 93 audio latents per channel and the prompt, which the transformer runs on."""
    from diffusers import MiniMaxH3Transformer3DModel

    from zeropipe.families.diffusion.entries import architecture_named

    arch = architecture_named("minimax-h3")
    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel(**arch.record.preset["transformer"])
        inputs = arch.call.trace_inputs(model.config, 4, (56 - 1) // 4 + 1, 8, torch.bfloat16)
        video, audio = model(**inputs, return_dict=False)
    assert inputs["hidden_states"].shape[1] == 17 * 2 * 2 and inputs["audio_hidden_states"].shape[1] == 2 * 93
    assert inputs["position_ids"].shape[0] == 17 * 2 * 2 + 2 * 93 + 8 and inputs["timestep"].shape == (2,)  # the video's and the audio's level
    assert video.shape == inputs["hidden_states"].shape and audio.shape == inputs["audio_hidden_states"].shape
