"""A diffusers pipeline folder has one reader: ``config.pipeline_index``.

Its ``model_index.json`` and its components' config files are read there and nowhere else, and
a missing or damaged file is reported as a message that names the file and the fix, never as a
traceback, whichever command meets it first.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import zeropipe
from zeropipe.cli.main import main
from zeropipe.config.pipeline_index import INDEX_FILE, PipelineIndex, is_pipeline_folder, read_pipeline_index
from zeropipe.errors import ConfigError

SRC = Path(zeropipe.__file__).parent
READER = SRC / "config" / "pipeline_index.py"

# Modules that are about diffusion pipelines only: a component's config file is read through the reader there too.
DIFFUSION_MODULES = [
    *sorted((SRC / "families" / "diffusion").rglob("*.py")),
    SRC / "convert" / "diffusion_pipe.py",
    SRC / "convert" / "diffusion_pipe_dataset.py",
]

INDEX = {
    "_class_name": "StableDiffusionXLPipeline",
    "_diffusers_version": "0.35.0",
    "force_zeros_for_empty_prompt": True,
    "unet": ["diffusers", "UNet2DConditionModel"],
    "vae": ["diffusers", "AutoencoderKL"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "feature_extractor": [None, None],
    "scheduler": ["diffusers", "EulerDiscreteScheduler"],
}


def string_constants(module: Path) -> set[str]:
    return {node.value for node in ast.walk(ast.parse(module.read_text())) if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def test_no_module_but_the_reader_names_model_index_json_as_a_file_to_open():
    # A file name on its own (path / "model_index.json") is a read or a probe; messages that mention it are longer strings.
    readers = [str(m.relative_to(SRC)) for m in sorted(SRC.rglob("*.py")) if m != READER and {INDEX_FILE, "scheduler_config.json"} & string_constants(m)]
    assert readers == [], f"read model_index.json through zeropipe.config.pipeline_index, not in {readers}"


def test_diffusion_modules_read_component_configs_through_the_reader():
    readers = [str(m.relative_to(SRC)) for m in DIFFUSION_MODULES if "config.json" in string_constants(m)]
    assert readers == [], f"read a pipeline component's config.json with PipelineIndex.component_config, not in {readers}"


def write_folder(tmp_path: Path, index: dict | str | None = INDEX) -> Path:
    folder = tmp_path / "pipe"
    folder.mkdir()
    if index is not None:
        (folder / INDEX_FILE).write_text(index if isinstance(index, str) else json.dumps(index))
    return folder


def test_the_folder_says_its_class_components_and_settings(tmp_path):
    folder = write_folder(tmp_path)
    (folder / "vae").mkdir()
    (folder / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL", "block_out_channels": [32, 64]}))
    (folder / "scheduler").mkdir()
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps({"_class_name": "EulerDiscreteScheduler"}))

    pipeline = read_pipeline_index(folder)
    assert isinstance(pipeline, PipelineIndex) and is_pipeline_folder(folder)
    assert pipeline.class_name == "StableDiffusionXLPipeline"
    assert pipeline.components() == {
        "unet": ("diffusers", "UNet2DConditionModel"), "vae": ("diffusers", "AutoencoderKL"),
        "text_encoder": ("transformers", "CLIPTextModel"), "scheduler": ("diffusers", "EulerDiscreteScheduler"),
    }
    assert pipeline.component("feature_extractor") == (None, None) and not pipeline.has_component("feature_extractor")
    assert pipeline.component("transformer_2") == (None, None)
    assert pipeline.setting("force_zeros_for_empty_prompt") is True
    assert pipeline.setting("boundary_ratio") is None and pipeline.setting("unet") is None  # a component is not a setting
    assert pipeline.settings(["force_zeros_for_empty_prompt", "unet", "is_distilled"]) == {"force_zeros_for_empty_prompt": True}
    assert pipeline.component_config("vae")["block_out_channels"] == [32, 64]
    assert pipeline.scheduler_config()["_class_name"] == "EulerDiscreteScheduler"


def problem(err: pytest.ExceptionInfo) -> tuple[str | None, str]:
    assert len(err.value.problems) == 1
    return err.value.problems[0]


def test_a_folder_without_model_index_json_is_named_with_the_fix(tmp_path):
    folder = write_folder(tmp_path, index=None)
    assert not is_pipeline_folder(folder)
    with pytest.raises(ConfigError) as err:
        read_pipeline_index(folder)
    key, message = problem(err)
    assert key == "model.path"
    assert f"{folder / INDEX_FILE} is missing" in message and "point it at a diffusers pipeline folder" in message


def test_a_path_that_is_no_folder_is_named(tmp_path):
    with pytest.raises(ConfigError) as err:
        read_pipeline_index(tmp_path / "nowhere", key=None)
    key, message = problem(err)
    assert key is None and f"{tmp_path / 'nowhere'} is not a folder" in message


def test_damaged_json_is_named_with_its_line(tmp_path):
    folder = write_folder(tmp_path, index='{\n  "_class_name": "FluxPipeline",\n  "transformer": ["diffusers" "FluxTransformer2DModel"]\n}')
    with pytest.raises(ConfigError) as err:
        read_pipeline_index(folder)
    _, message = problem(err)
    assert f"{folder / INDEX_FILE} is not valid JSON (line 3" in message and "fix or replace the file" in message


def test_json_that_is_not_an_object_is_named(tmp_path):
    folder = write_folder(tmp_path, index="[1, 2]")
    with pytest.raises(ConfigError) as err:
        read_pipeline_index(folder)
    assert f"{folder / INDEX_FILE} holds a JSON list, not an object" in problem(err)[1]


def test_a_missing_or_damaged_component_config_is_named(tmp_path):
    folder = write_folder(tmp_path)
    pipeline = read_pipeline_index(folder)
    with pytest.raises(ConfigError) as err:
        pipeline.component_config("vae")
    assert f"{folder / 'vae' / 'config.json'} is missing (the pipeline's vae config)" in problem(err)[1]
    (folder / "vae").mkdir()
    (folder / "vae" / "config.json").write_text("{")
    with pytest.raises(ConfigError) as err:
        pipeline.component_config("vae")
    assert f"{folder / 'vae' / 'config.json'} is not valid JSON" in problem(err)[1]


def test_a_component_the_caller_needs_and_the_index_lacks_is_named(tmp_path):
    pipeline = read_pipeline_index(write_folder(tmp_path))
    assert pipeline.required_component("vae") == ("diffusers", "AutoencoderKL")
    with pytest.raises(ConfigError) as err:
        pipeline.required_component("image_encoder")
    assert f"{pipeline.index_file} names no image_encoder component, which this StableDiffusionXLPipeline needs" in problem(err)[1]


def test_the_architecture_of_a_damaged_pipeline_is_a_config_error():
    from zeropipe.families.diffusion.entries import architecture_of

    with pytest.raises(ConfigError, match="is not a folder: point it at a diffusers pipeline folder"):
        architecture_of(Path("/nonexistent-zeropipe-test"))


def test_plan_on_a_damaged_pipeline_prints_the_file_and_the_fix_not_a_traceback(tmp_path, capsys):
    folder = write_folder(tmp_path, index='{"_class_name": "FluxPipeline",')
    assert main(["plan", "--model", str(folder), "--gpus", "1x80GB", "--ram", "64GB"]) == 2
    err = capsys.readouterr().err
    assert f"{folder / INDEX_FILE} is not valid JSON (line 1" in err
    assert "Traceback" not in err
