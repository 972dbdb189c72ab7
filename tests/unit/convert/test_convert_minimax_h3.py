"""diffusion-pipe's own MiniMax-H3 example ([model] type = 'minimax_h3') converts to the minimax-h3 entry: its CFG-augmented
training (cfg) to the guidance-preserving objective, its clip lengths to the ones with the same latent frames."""

from __future__ import annotations

import re

import yaml

from tests.unit.convert.test_convert_issue27 import DP, images, unmapped, values
from zeropipe.config.load import validate_config
from zeropipe.convert import convert_file
from zeropipe.convert.diffusion_pipe import is_video, trainable_architecture


def test_diffusion_pipes_minimax_h3_example_trains_the_entry_with_its_cfg_and_the_same_latent_frames(tmp_path):
    assert trainable_architecture("minimax_h3") == "minimax-h3" and is_video("minimax_h3")
    videos, stills = images(tmp_path, "videos"), images(tmp_path, "stills")
    dataset = (DP / "minimax_h3_dataset.toml").read_text().replace("'/path/to/videos'", f"'{videos}'").replace("'/path/to/images'", f"'{stills}'")
    (tmp_path / "dataset.toml").write_text(dataset)
    release = tmp_path / "MiniMax-H3"
    release.mkdir()
    (release / "modular_model_index.json").write_text('{"_class_name": "MiniMaxH3ModularPipeline"}')
    text = (DP / "minimax_h3_example.toml").read_text()
    text = re.sub(r"(?m)^dataset = .*$", f"dataset = '{tmp_path / 'dataset.toml'}'", text)
    text = re.sub(r"(?m)^type = 'minimax_h3'$", f"type = 'minimax_h3'\ndiffusers_path = '{release}'", text)
    (tmp_path / "main.toml").write_text(text)

    conversion = convert_file(tmp_path / "main.toml")
    assert conversion.blocking == []
    got = values(conversion)
    assert got["model.path"] == str(release)
    # Theirs: [1, 34, 68, 102, 136], rounded down to 17-frame chunks (5k-3 latent frames); ours 17k+5 frames, the same latents.
    assert got["data.video.frame_buckets"] == [1, 22, 56, 90, 124]
    assert got["model.diffusion.guidance_preserving"] == 4.0 and got["model.diffusion.shift"] == 8.0
    why = unmapped(conversion)
    assert "MiniMaxAI/MiniMax-H3" in why["model.diffusion_model"] and "audio_vae/" in why["model.audio_vae"] and {"model.vae", "model.text_encoders"} <= set(why)
    assert "one-frame" in why["model.image_shift"]
    raw = yaml.safe_load(conversion.to_yaml())
    raw["data"]["path"] = str(videos)  # the links folder the conversion writes when it is saved
    config = validate_config(raw)
    assert config.model.diffusion.guidance_preserving == 4.0
