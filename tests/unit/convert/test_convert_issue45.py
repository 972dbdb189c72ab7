"""Issue 45: the peers' defaults written, nothing trains that convert said it cannot, `check` refuses what `train` would.

Each test names the defect of the issue it covers (1-9); each failed on the main it was written against.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from tests.unit.convert.test_convert_diffusion_pipe import image_dir, unmapped, values, write
from zeropipe.config.load import validate_config
from zeropipe.convert import convert_file


# ----------------------------------------------------------------------------------- 1: diffusion-pipe's shift
@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory) -> Path:
    """A Wan pipeline folder's index and scheduler, as Wan-AI's diffusers releases ship them: UniPC with flow_shift 3.0 (480p),
    which ZeRO-Pipe's shift: auto would take. The sampler reads no other file."""
    from diffusers import UniPCMultistepScheduler

    folder = tmp_path_factory.mktemp("wan") / "Wan2.1-T2V-1.3B-Diffusers"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "scheduler": ["diffusers", "UniPCMultistepScheduler"],
                                                         "transformer": ["diffusers", "WanTransformer3DModel"], "vae": ["diffusers", "AutoencoderKLWan"]}))
    UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0).save_pretrained(folder / "scheduler")
    return folder


def diffusion_pipe_quantile(q: torch.Tensor, shift: float) -> torch.Tensor:
    """diffusion-pipe's noise level at quantile q: t = sigmoid(N(0,1)) (utils/common.py get_t_distribution), then t = shift*t / (1 + (shift-1)*t)."""
    t = torch.sigmoid(torch.special.ndtri(q))
    return shift * t / (1 + (shift - 1) * t)


@pytest.mark.parametrize(("line", "shift"), [("", 1.0), ("shift = 3.0\n", 3.0), ("shift = 7\n", 7.0)], ids=["unset", "3.0", "7"])
def test_1_a_converted_wan_run_draws_diffusion_pipes_timesteps(tmp_path, tiny_wan, line, shift):
    """The noise levels a converted run trains on (ZeRO-Pipe's own sampler, on the converted config and the pipeline's scheduler)
    follow diffusion-pipe's formula with the file's shift, 1.0 when the file has none (main took the scheduler's 3.0: median 0.75, not 0.5)."""
    from zeropipe.config.pipeline_index import read_pipeline_index
    from zeropipe.diffusion.objectives import FlowObjective

    clips = image_dir(tmp_path, "clips")
    path = write(tmp_path, f"dataset = 'dataset.toml'\n[model]\ntype = 'wan'\ndiffusers_path = '{tiny_wan}'\n{line}", f"resolutions = [64]\n[[directory]]\npath = '{clips}'\n")
    conversion = convert_file(path)
    entry = conversion.entries["model.diffusion.shift"]
    assert entry.value == shift and ("[model] shift" in entry.comment if line else "models/wan/wan.py" in entry.comment)
    assert "model.shift" not in unmapped(conversion), "a key with an equivalent is mapped, not listed"
    config = validate_config({**conversion.raw(), "run": {"name": "wan"}})
    objective = FlowObjective(read_pipeline_index(tiny_wan).scheduler_config(), config.model.diffusion)
    drawn = objective.sigmas(40_000, torch.Generator().manual_seed(0)).double().sort().values
    quantiles = (torch.arange(1, 20, dtype=torch.float64) / 20)
    expected = diffusion_pipe_quantile(quantiles, shift)
    observed = drawn[(quantiles * len(drawn)).long()]
    assert torch.allclose(observed, expected, atol=0.01), list(zip(expected.tolist(), observed.tolist()))
    assert abs(float(drawn.median()) - shift / (1 + shift)) < 0.01  # sigmoid(0) = 0.5, shifted
