"""Cosmos 3 Omni in the planner: Cosmos3-Nano counted from its published transformer config, and its activations traced on the
meta device (its transformer turns autocast off for its position ids' device, which the trace makes a no-op on meta)."""

from __future__ import annotations

import json

import torch

from tests.unit.plan.test_plan_kandinsky_krea_ernie_catalog import meta_count
from zeropipe.plan.model_spec import CATALOG_DIR


def test_the_catalog_entry_counts_the_published_transformer():
    entry = json.loads((CATALOG_DIR / "cosmos3-nano.json").read_text())
    assert entry["architecture"] == "cosmos3" and entry["source"].startswith("nvidia/Cosmos3-Nano ")
    config = entry["trained"]["config"]
    # Qwen3-VL-8B's text backbone, both pathways, with the sound and action heads the released config switches on.
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (4096, 36, 151936)
    assert meta_count(entry["trained"]) == 15_173_669_120


def test_the_trace_runs_the_transformer_on_the_meta_device_and_leaves_autocast_as_it_was(spec_of):
    """The trace of a tiny Cosmos 3 transformer: its inputs packed by the pipeline's own helpers, its mRoPE's autocast switch
    passing on the meta device; torch.autocast is torch's own again afterwards, and refuses "meta" as before."""
    from diffusers import Cosmos3OmniTransformer

    from zeropipe.families.diffusion.entries import architecture_named
    from zeropipe.plan.trace import trace_diffusion

    arch = architecture_named("cosmos3")
    real = torch.autocast
    with torch.device("meta"):
        model = Cosmos3OmniTransformer.from_config(arch.record.preset["transformer"]).to(torch.bfloat16)
        inputs = arch.call.trace_inputs(model.config, 4, 3, 20, torch.bfloat16)
    assert inputs["vision_tokens"][0].shape == (1, 48, 3, 4, 4) and inputs["input_ids"].shape == (20,)
    assert all(value.device.type == "meta" for value in inputs.values() if isinstance(value, torch.Tensor))
    trace = trace_diffusion(model, lambda: inputs, 64, frames=9)
    assert trace.saved_bytes > trace.checkpointed_bytes > 0 and trace.forward_flops > 0
    assert torch.autocast is real
    try:
        with torch.autocast(device_type="meta"):
            refused = False
    except RuntimeError:
        refused = True
    assert refused
    # The catalog's Cosmos3-Nano is traced too (a stored trace of its 480 px x 49-frame clip): activations are in its plan.
    spec = spec_of("cosmos3-nano", 32)
    assert spec.activation_trace is not None and spec.activation_trace.frames == 49
