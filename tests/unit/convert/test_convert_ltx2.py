"""diffusion-pipe's LTX-2 config ([model] type = 'ltx2') converts to the ltx2 entry; its single-file keys say where the model comes from."""

from __future__ import annotations

from tests.unit.convert.test_convert_diffusion_pipe import image_dir, unmapped, values, write
from zeropipe.convert import convert_file
from zeropipe.convert.diffusion_pipe import is_video, trainable_architecture


def test_a_diffusion_pipe_ltx2_config_trains_the_ltx2_entry_and_names_the_diffusers_release(tmp_path):
    assert trainable_architecture("ltx2") == "ltx2" and is_video("ltx2")
    clips = image_dir(tmp_path, "clips", images=0, videos=2)
    ltx2 = tmp_path / "LTX-2"
    ltx2.mkdir()
    (ltx2 / "model_index.json").write_text('{"_class_name": "LTX2Pipeline"}')
    path = write(
        tmp_path,
        f"dataset = 'dataset.toml'\n[model]\ntype = 'ltx2'\ndiffusers_path = '{ltx2}'\ndiffusion_model = '/models/ltx-2-19b-dev.safetensors'\n"
        "text_encoder = '/models/gemma-3-12b-it'\ndtype = 'bfloat16'\ndiffusion_model_dtype = 'float8'\n[adapter]\ntype = 'lora'\nrank = 32\n",
        f"resolutions = [512]\nframe_buckets = [49]\n[[directory]]\npath = '{clips}'\n",
    )
    conversion = convert_file(path)
    assert conversion.blocking == []
    got = values(conversion)
    assert got["model.path"] == str(ltx2) and got["data.video.frame_buckets"] == [1, 49] and got["deepspeed.precision"] == "bf16"
    why = unmapped(conversion)
    assert "Lightricks/LTX-2" in why["model.diffusion_model"] and "text_encoder/" in why["model.text_encoder"]
    assert got["model.quantization.format"] == "fp8", "diffusion_model_dtype = 'float8' keeps the fp8 base"
