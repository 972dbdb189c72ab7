"""Kandinsky 6's pi-Flow distilled checkpoints are refused before anything runs, with why and what to train instead (docs/video.md,
Kandinsky 6): their transformer's heads predict PiflowScheduler's velocity grids, which only the teacher's imitation distillation trains."""

from __future__ import annotations

import json
import re

import pytest
import torch

from zeropipe.families.diffusion.bases.kandinsky6 import ARCHITECTURE as K6
from zeropipe.families.diffusion.bases.kandinsky6 import LORA_TARGETS

N_GRID = 10  # PiflowScheduler's default, the released distilled checkpoints' number of grids


def release_folder(root, distilled: bool):
    """A Kandinsky 6 release's folder as the checks read it (model_index.json, the transformer's and the scheduler's configs): the tiny
    preset's transformer, its heads widened to N_GRID grids and PiflowScheduler for the distilled one, as the release's -distill- folders."""
    from diffusers import FlowMatchEulerDiscreteScheduler, PiflowScheduler

    transformer = dict(K6.record.preset["transformer"])
    scheduler = PiflowScheduler(n_grid=N_GRID) if distilled else FlowMatchEulerDiscreteScheduler(shift=10.0)
    if distilled:
        transformer.update(out_visual_dim=N_GRID * transformer["in_visual_dim"], out_audio_dim=N_GRID * transformer["in_audio_dim"])
    root.mkdir()
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "Kandinsky6TI2VAPipeline", "_diffusers_version": "0.42.1",
        "transformer": ["diffusers", "Kandinsky6Transformer3DModel"], "scheduler": ["diffusers", type(scheduler).__name__],
    }))
    (root / "transformer").mkdir()
    (root / "transformer" / "config.json").write_text(json.dumps({"_class_name": "Kandinsky6Transformer3DModel", **transformer}))
    scheduler.save_config(str(root / "scheduler"))
    return root, transformer


@pytest.mark.parametrize("task", ["auto", "image-to-video"])
def test_a_distilled_checkpoint_is_refused_naming_why_and_the_checkpoint_to_train_instead(tmp_path, task):
    """zeropipe check and train (both ask the family's config_problems) refuse the distilled folder under model.path, as text- and as
    image-to-video, with one message that says what makes it distilled, why it cannot be fine-tuned and what to train; the sft folder passes."""
    from zeropipe.config.schema import RunConfig
    from zeropipe.families.diffusion import FAMILY

    def problems(folder):
        config = RunConfig.model_validate({"model": {"path": str(folder), "diffusion": {"task": task}}, "data": {"path": str(tmp_path)}})
        assert FAMILY.architecture(config).record.name == ("kandinsky6" if task == "auto" else "kandinsky6-i2v")
        return [problem for problem in FAMILY.config_problems(config) if problem[0] == "model.path"]

    distilled, _ = release_folder(tmp_path / "Kandinsky-6.0-Pro-distill-5s-Diffusers", distilled=True)
    sft, _ = release_folder(tmp_path / "Kandinsky-6.0-Pro-5s-Diffusers", distilled=False)
    assert problems(sft) == []
    [(key, message)] = problems(distilled)
    assert key == "model.path" and message.startswith(f"{distilled} is a pi-Flow distilled Kandinsky 6 checkpoint (its transformer's out_visual_dim 160 is 10 x in_visual_dim 16")
    for said in ("out_audio_dim 80 is 10 x in_audio_dim 8", "its scheduler is PiflowScheduler with n_grid 10", "imitation distillation", "teacher",
                 "Train the non-distilled release", "kandinskylab/Kandinsky-6.0-Pro-5s-Diffusers", "as kandinsky6"):
        assert said in message, said


def test_the_distilled_transformer_widens_only_its_output_layers_so_the_loras_modules_are_the_sft_checkpoints(tmp_path):
    """What the docs say of a LoRA trained on the sft checkpoint: every module it adapts has the same name and shape in the distilled
    transformer (only out_layer and audio_out_layer are widened, and the LoRA targets neither)."""
    from diffusers import Kandinsky6Transformer3DModel

    _, sft = release_folder(tmp_path / "sft", distilled=False)
    _, distilled = release_folder(tmp_path / "distilled", distilled=True)

    def shapes(config):
        with torch.device("meta"):
            model = Kandinsky6Transformer3DModel(**config)
        return {name: tuple(parameter.shape) for name, parameter in model.named_parameters()}

    ours, theirs = shapes(sft), shapes(distilled)
    assert ours.keys() == theirs.keys()
    widened = {name.rsplit(".", 2)[0] for name in ours if ours[name] != theirs[name]}
    assert widened == {"out_layer", "audio_out_layer"}, widened
    targeted = {name.rsplit(".", 1)[0] for name in ours if re.fullmatch(LORA_TARGETS, name.rsplit(".", 1)[0])}
    assert targeted and not any(module.startswith(("out_layer.", "audio_out_layer.")) for module in targeted)


def test_flow_matching_on_data_through_the_policy_draws_the_datas_mean_where_the_teachers_imitation_draws_the_teachers_sample():
    """The reason in the refusal, on benchmarks/piflow_objectives.py's toy (data at -1 and +1, its exact teacher, the scheduler's own DX
    policy, rollout and step): the grid fitted by flow matching on data through the policy draws, in one PiflowScheduler step, the data's
    mean; fitted by pi-Flow's imitation of the teacher, the teacher's own sample."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("piflow_objectives", Path(__file__).parents[3] / "benchmarks" / "piflow_objectives.py")
    toy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(toy)
    x_src = torch.tensor([[0.3]])
    reference = float(toy.teacher_endpoint(x_src, steps=1024))
    data = float(toy.one_step(toy.fit("data", x_src, 150, batch=64), x_src))
    imitated = float(toy.one_step(toy.fit("pi-ID", x_src, 150, batch=64, substeps=24), x_src))
    assert abs(reference - 1) < 0.01  # the teacher takes this noise to the data point +1
    assert abs(imitated - reference) < 0.1, (imitated, reference)
    assert abs(data) < 0.35 and abs(data - reference) > 0.6, (data, reference)
