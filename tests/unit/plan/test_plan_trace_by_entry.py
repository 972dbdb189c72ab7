"""The planner asks a diffusion architecture entry for its trace; it never branches on a model's class name.

An entry says what its denoiser takes (``trace_inputs``), whether its latents have frames
(``video``) and the prompt and clip length to trace when the spec does not say
(``trace_text_tokens``, ``trace_frames``). A plug-in entry is traced through those hooks alone.
"""

from __future__ import annotations

import ast
import json
import dataclasses
from pathlib import Path

import pytest

import zeropipe.plan
from zeropipe.families.diffusion.entries import architectures, register, unregister
from zeropipe.families.diffusion.entries.sd15 import ARCHITECTURE as SD15
from zeropipe.families.diffusion.bases.unet import UNetCall
from zeropipe.families.diffusion.core import Architecture
from zeropipe.plan.model_spec import spec_from_path


def test_the_planner_names_no_pipeline_or_denoiser_class():
    names = {a.record.denoiser_class for a in architectures().values()} | {a.record.pipeline_class for a in architectures().values()} | {"Transformer"}
    found = {}
    for module in sorted(Path(zeropipe.plan.__file__).parent.glob("*.py")):
        constants = {n.value for n in ast.walk(ast.parse(module.read_text())) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        if constants & names:
            found[module.name] = sorted(constants & names)
    assert found == {}, f"the planner branches on class names: {found}; ask the architecture entry (DenoiserCall.trace_inputs) instead"


class TracedUNetCall(UNetCall):
    """SD 1.x's denoiser call with a spy on its trace inputs."""

    def trace_inputs(self, config, latent_side, latent_frames, text_tokens, dtype):
        self.calls.append((latent_side, latent_frames, text_tokens))
        return None if self.untraced else super().trace_inputs(config, latent_side, latent_frames, text_tokens, dtype)


@pytest.fixture
def entry():
    # SD 1.x's layout under its own pipeline class, with a prompt length of its own.
    record = dataclasses.replace(SD15.record, name="traced-unet", pipeline_class="TracedUNetPipeline", related_pipelines=(), preset_name=None, trace_tokens=5)
    arch = Architecture(record=record, call=TracedUNetCall(), prompts=SD15.prompts)
    arch.call.calls, arch.call.untraced = [], False
    register(arch)
    yield arch
    unregister("traced-unet")


def pipeline_folder(tmp_path: Path) -> Path:
    """A pipeline folder the planner reads: model_index.json naming the entry's pipeline class, and the UNet's config (built on meta)."""
    folder = tmp_path / "traced"
    (folder / "unet").mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "TracedUNetPipeline", "unet": ["diffusers", "UNet2DConditionModel"]}))
    (folder / "unet" / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel", **SD15.record.preset["unet"]}))
    return folder


def test_a_registered_entry_makes_the_inputs_the_planner_traces(tmp_path, entry):
    spec = spec_from_path(pipeline_folder(tmp_path))
    # 1024 px over the VAE's default 8 px per latent; one frame (not video); the entry's own prompt length.
    assert entry.call.calls == [(128, 1, 5)]
    assert spec.activation_trace is not None and spec.activation_trace.frames == 1 and spec.activation_trace.saved_bytes > 0


def test_an_entry_without_trace_inputs_gets_no_activation_term(tmp_path, entry):
    entry.call.untraced = True
    spec = spec_from_path(pipeline_folder(tmp_path))
    assert entry.call.calls and spec.activation_trace is None
    assert spec.total_params > 0  # the parameters are still counted
