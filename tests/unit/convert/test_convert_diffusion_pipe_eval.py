"""diffusion-pipe's eval settings -> ZeRO-Pipe's validation loss (issue 44): eval_datasets as data.eval_path, eval_every_n_steps as train.eval_every."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.unit.convert.test_convert_diffusion_pipe import image_dir, pipeline_dir, unmapped, values
from zeropipe.config.load import validate_config
from zeropipe.convert import convert_file

PEER_EXAMPLE = Path(__file__).parents[2] / "fixtures" / "peers" / "diffusion-pipe" / "examples" / "main_example.toml"


def peer_example_with_eval(tmp_path: Path) -> Path:
    """diffusion-pipe's main_example.toml with its eval_datasets lines uncommented, as its comment suggests, and eval by steps."""
    flux = pipeline_dir(tmp_path)
    train_images, held_out = image_dir(tmp_path, "photos"), image_dir(tmp_path, "held-out")
    text = PEER_EXAMPLE.read_text()
    text = text.replace("# eval_datasets = [\n#     {name = 'something', config = 'path/to/eval_dataset.toml'},\n# ]",
                        "eval_datasets = [\n    {name = 'something', config = 'eval_dataset.toml'},\n]")
    text = text.replace("eval_every_n_epochs = 1\n", "").replace("#eval_every_n_steps = 100", "eval_every_n_steps = 100")
    text = text.replace("dataset = 'examples/dataset.toml'", "dataset = 'dataset.toml'")
    assert "eval_datasets = [\n" in text and "\neval_every_n_steps = 100" in text
    text = text.replace("output_dir = '/data/diffusion_pipe_training_runs/hunyuan_video_test'", f"output_dir = '{tmp_path / 'runs'}'")
    start = text.index("[model]")
    text = text[:start] + f"[model]\ntype = 'flux'\ndiffusers_path = '{flux}'\ndtype = 'bfloat16'\n" + text[text.index("\n[adapter]") + 1:]
    (tmp_path / "dataset.toml").write_text(f"resolutions = [512]\n[[directory]]\npath = '{train_images}'\nnum_repeats = 1\n")
    (tmp_path / "eval_dataset.toml").write_text(f"resolutions = [512]\n[[directory]]\npath = '{held_out}'\n")
    path = tmp_path / "main.toml"
    path.write_text(text)
    return path


def test_peer_eval_datasets_become_the_held_out_folder_and_the_yaml_validates(tmp_path):
    conversion = convert_file(peer_example_with_eval(tmp_path))
    mapped = values(conversion)
    assert mapped["data.eval_path"] == str(tmp_path / "held-out")
    assert mapped["train.eval_every"] == 100
    skipped = unmapped(conversion)
    assert "one held-out image per forward pass" in skipped["eval_micro_batch_size_per_gpu"]
    assert "fixed_batch_loss_start" in skipped["eval_before_first_step"]
    assert "eval_datasets" not in skipped
    config = validate_config(yaml.safe_load(conversion.to_yaml("out.yaml")))
    assert config.data.eval_path == str(tmp_path / "held-out") and config.train.eval_every == 100


def test_eval_by_steps_without_eval_datasets_is_left_out_with_the_fix(tmp_path):
    path = peer_example_with_eval(tmp_path)
    path.write_text(path.read_text().replace("eval_datasets = [\n    {name = 'something', config = 'eval_dataset.toml'},\n]", ""))
    conversion = convert_file(path)
    assert "data.eval_path" not in values(conversion) and "train.eval_every" not in values(conversion)
    assert "set data.eval_path (or data.eval_fraction) and train.eval_every" in unmapped(conversion)["eval_every_n_steps"]
