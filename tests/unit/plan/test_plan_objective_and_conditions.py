"""What the planner's diffusion trace counts beyond one plain call: an objective that calls the denoiser on more than the
micro-batch (FLUX.3 [distilled]'s flow map), a reference frame the entry's call adds (Wan VACE's reference image, Kandinsky 6's
image-to-video tail frame, chosen by model.diffusion.task)."""

from __future__ import annotations

import pytest
import torch

from zeropipe.errors import ConfigError
from zeropipe.plan.activations import saved_activation_bytes
from zeropipe.plan.memory import Choice


def test_the_flow_map_objective_counts_its_doubled_gradient_call(spec_of):
    """The flow-map loss calls the transformer with gradient on the micro-batch twice (and twice without): its activations are
    twice one call's, and the cost model adds the gradient-free passes; FLUX.3's plain flow matching is one call."""
    from dataclasses import replace

    from zeropipe.families.diffusion.entries import architecture_named
    from zeropipe.families.diffusion.parts import flow_map

    distilled = spec_of("flux3-distilled", 32)
    assert (distilled.sequences_per_example, distilled.reference_forward) == (flow_map.GRADIENT_BATCH, True) == (2, True)
    plain = architecture_named("flux3").call  # FLUX.3's plain flow matching: the default loss, one call on the micro-batch
    assert (plain.gradient_batch, plain.gradient_free_batch) == (1, 0)
    for checkpointing in (True, False):
        choice = Choice(zero_stage=3, micro_batch_size=3, gradient_checkpointing=checkpointing)
        one_call = saved_activation_bytes(replace(distilled, sequences_per_example=1), choice)
        assert saved_activation_bytes(distilled, choice) == 2 * one_call > 0


def test_the_vace_trace_counts_a_reference_images_latent_frame():
    from zeropipe.families.diffusion.bases.wan_vace import TRACED_REFERENCE_SLOTS
    from zeropipe.families.diffusion.entries import architecture_named

    arch = architecture_named("wan-vace")
    model = arch.model_class()(**arch.record.preset["transformer"])
    with torch.device("meta"):
        inputs = arch.call.trace_inputs(model.config, 4, 3, 8, torch.bfloat16)
    assert TRACED_REFERENCE_SLOTS == 1
    assert inputs["hidden_states"].shape[2] == inputs["control_hidden_states"].shape[2] == 3 + 1


def tiny_kandinsky6(task: str = "auto", architecture: str = "kandinsky6") -> dict:
    from zeropipe.families.diffusion.entries import architecture_named

    arch = architecture_named(architecture)
    config = {"_class_name": arch.record.denoiser_class, **arch.record.preset["transformer"]}
    return {"name": "tiny-kandinsky6", "family": "diffusion_transformer", "architecture": architecture, "resolution": 64, "frames": 9,
            "vae_factor": 8, "vae_temporal_factor": 4, "text_tokens": 16, "task": task,
            "trained": {"name": "transformer", "library": "diffusers", "class": arch.record.denoiser_class, "config": config}}


def test_a_catalog_plan_with_model_diffusion_task_traces_the_tasks_entry():
    """Kandinsky 6's one checkpoint trains text- or image-to-video: planned with task image-to-video the trace is the
    image-to-video entry's, one more latent frame (the reference tail frame), and its stored-trace key is its own."""
    from zeropipe.plan.model_spec import diffusion_specs

    t2v = diffusion_specs().catalog_entry(tiny_kandinsky6(), None).activation_trace
    i2v = diffusion_specs().catalog_entry(tiny_kandinsky6("image-to-video"), None).activation_trace
    assert i2v.saved_bytes > t2v.saved_bytes and i2v.checkpointed_bytes > t2v.checkpointed_bytes
    # 3 latent frames + the tail frame: the video stream's checkpointed inputs grow by a third (the text and audio do not).
    assert i2v.checkpointed_bytes < t2v.checkpointed_bytes * 4 / 3


def test_a_task_the_catalog_model_has_no_entry_for_is_refused_naming_the_key():
    from zeropipe.plan.model_spec import diffusion_specs

    entry = dict(tiny_kandinsky6(), architecture="wan-vace")
    entry["trained"] = tiny_kandinsky6(architecture="wan-vace")["trained"]
    with pytest.raises(ConfigError) as err:
        diffusion_specs().catalog_entry(dict(entry, task="image-to-video"), None)
    assert "model.diffusion.task" in str(err.value) and "image-to-video" in str(err.value)


def test_the_trace_key_names_the_entry_only_where_asked():
    """Traces stored before keep their keys (no entry named); an entry sharing its folder's config gets a key of its own."""
    from zeropipe.plan.trace_store import trace_key

    model = torch.nn.Linear(2, 2)
    trained = {"class": "X", "config": {"a": 1}}
    plain = trace_key(model, trained, 64, 9, 8, 3, 16)
    assert plain == trace_key(model, trained, 64, 9, 8, 3, 16, entry=None)
    assert trace_key(model, trained, 64, 9, 8, 3, 16, entry="kandinsky6-i2v") != plain
