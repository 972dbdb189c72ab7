"""diffusion-pipe configs of the 2026 video models: their type names map to ZeRO-Pipe's entries, their ComfyUI files to the diffusers release."""

from __future__ import annotations

from zeropipe.convert import convert_file
from zeropipe.convert.diffusion_pipe import trainable_architecture


def test_hunyuan_video_15_comfyui_files_point_at_the_diffusers_release(tmp_path):
    """diffusion-pipe's docs/supported_models.md HunyuanVideo-1.5 block, as a user has it."""
    clips = tmp_path / "clips"
    clips.mkdir()
    (tmp_path / "dataset.toml").write_text(f"resolutions = [480]\nframe_buckets = [1, 33]\n[[directory]]\npath = '{clips}'\n")
    (tmp_path / "hv15.toml").write_text(
        "output_dir = 'out'\ndataset = 'dataset.toml'\nepochs = 10\nmicro_batch_size_per_gpu = 1\n[model]\ntype = 'hunyuan_video_15'\n"
        "diffusion_model = '/m/hunyuanvideo1.5_480p_t2v_fp16.safetensors'\nvae = '/m/hunyuanvideo15_vae_fp16.safetensors'\n"
        "text_encoders = [{paths = ['/m/qwen_2.5_vl_7b.safetensors', '/m/byt5_small_glyphxl_fp16.safetensors'], type = 'hunyuan_video_15'}]\n"
        "dtype = 'bfloat16'\ntimestep_sample_method = 'logit_normal'\n[adapter]\ntype = 'lora'\nrank = 32\n"
    )
    conversion = convert_file(tmp_path / "hv15.toml")
    assert trainable_architecture("hunyuan_video_15") == "hunyuan-video-1.5" and not conversion.blocking
    unmapped = dict(conversion.unmapped)
    assert "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v" in unmapped["model.diffusion_model"]
    assert set(unmapped) >= {"model.vae", "model.text_encoders"}
    assert conversion.entries["data.video.frame_buckets"].value == [1, 33]


def test_a_skyreels_v2_checkpoint_folder_of_diffusion_pipes_wan_type_points_at_skyworks_diffusers_release(tmp_path):
    """diffusion-pipe trains SkyReels-V2 as type 'wan' with ckpt_path its original folder (it tells it by the folder's name)."""
    clips = tmp_path / "clips"
    clips.mkdir()
    skyreels = tmp_path / "SkyReels-V2-I2V-14B-540P"
    skyreels.mkdir()
    (tmp_path / "dataset.toml").write_text(f"frame_buckets = [1, 49]\n[[directory]]\npath = '{clips}'\n")
    (tmp_path / "sky.toml").write_text(f"dataset = 'dataset.toml'\n[model]\ntype = 'wan'\nckpt_path = '{skyreels}'\ndtype = 'bfloat16'\n")
    conversion = convert_file(tmp_path / "sky.toml")
    assert not conversion.blocking
    assert "Skywork/SkyReels-V2-I2V-14B-540P-Diffusers" in dict(conversion.unmapped)["model.ckpt_path"]


def test_diffusion_pipes_kandinsky5_type_trains_the_entry_its_checkpoint_names(tmp_path):
    """diffusion-pipe's one kandinsky5 type is T2I, T2V or I2V by its ckpt_path's name; a video one keeps the dataset's frame buckets."""
    clips = tmp_path / "clips"
    clips.mkdir()
    (tmp_path / "dataset.toml").write_text(f"resolutions = [512]\nframe_buckets = [1, 33]\n[[directory]]\npath = '{clips}'\n")
    entries = {}
    for file, entry in (("kandinsky5lite_t2v_sft_5s", "kandinsky5-t2v"), ("kandinsky5pro_i2v_sft_5s", "kandinsky5-i2v"), ("kandinsky5lite_t2i", "kandinsky5-t2i")):
        (tmp_path / f"{file}.toml").write_text(f"dataset = 'dataset.toml'\n[model]\ntype = 'kandinsky5'\nckpt_path = '/m/{file}.safetensors'\ndtype = 'bfloat16'\n")
        conversion = convert_file(tmp_path / f"{file}.toml")
        assert not conversion.blocking, (file, conversion.blocking)
        entries[entry] = conversion
        assert any(entry in line for line in conversion.already), (file, conversion.already)
        assert "kandinskylab/Kandinsky-5.0-" in dict(conversion.unmapped)["model.ckpt_path"]
    assert entries["kandinsky5-t2v"].entries["data.video.frame_buckets"].value == [1, 33]
    assert "data.video.frame_buckets" not in entries["kandinsky5-t2i"].entries


def test_cosmos_predict2_single_files_point_at_nvidias_release_and_anima_is_refused(tmp_path):
    """diffusion-pipe's docs/supported_models.md Cosmos-Predict2 block, as a user has it; with llm_path the same type is Anima."""
    images = tmp_path / "images"
    images.mkdir()
    (tmp_path / "dataset.toml").write_text(f"resolutions = [1024]\n[[directory]]\npath = '{images}'\n")
    block = (
        "output_dir = 'out'\ndataset = 'dataset.toml'\nepochs = 10\nmicro_batch_size_per_gpu = 1\n[model]\ntype = 'cosmos_predict2'\n"
        "transformer_path = '/m/Cosmos-Predict2-2B-Text2Image/model.pt'\nvae_path = '/m/wan_2.1_vae.safetensors'\n{text}dtype = 'bfloat16'\n"
        "[adapter]\ntype = 'lora'\nrank = 32\n"
    )
    (tmp_path / "cosmos.toml").write_text(block.format(text="t5_path = '/m/oldt5_xxl_fp16.safetensors'\n"))
    conversion = convert_file(tmp_path / "cosmos.toml")
    assert trainable_architecture("cosmos_predict2") == "cosmos-predict2" and not conversion.blocking
    unmapped = dict(conversion.unmapped)
    assert "nvidia/Cosmos-Predict2-2B-Text2Image" in unmapped["model"]
    assert set(unmapped) >= {"model.vae_path", "model.t5_path", "model.transformer_path"}  # model.pt: the transformer comes from model.path
    (tmp_path / "anima.toml").write_text(block.format(text="llm_path = '/m/qwen_3_06b_base.safetensors'\n"))
    assert any("is Anima" in reason for reason in convert_file(tmp_path / "anima.toml").blocking)
