"""diffusion-pipe TOMLs -> ZeRO-Pipe keys, key by key; what cannot be mapped is listed with why."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from zeropipe.config.load import validate_config
from zeropipe.convert import ConversionError, convert_file, write_links


def pipeline_dir(root: Path, name: str = "flux-dev") -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    return folder


def image_dir(root: Path, name: str, images: int = 2, captions: bool = True, videos: int = 0) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    for i in range(images):
        (folder / f"{i}.png").write_bytes(b"png")
        if captions:
            (folder / f"{i}.txt").write_text("a caption")
    for i in range(videos):
        (folder / f"clip{i}.mp4").write_bytes(b"mp4")
    return folder


def write(tmp_path: Path, main: str, dataset: str, name: str = "main.toml") -> Path:
    (tmp_path / "dataset.toml").write_text(dataset)
    path = tmp_path / name
    path.write_text(main)
    return path


def values(conversion) -> dict:
    return {key: entry.value for key, entry in conversion.entries.items()}


def unmapped(conversion) -> dict:
    return dict(conversion.unmapped)


def test_flux_lora_maps_key_by_key(tmp_path):
    flux = pipeline_dir(tmp_path)
    images = image_dir(tmp_path, "photos")
    path = write(
        tmp_path,
        f"""
output_dir = '{tmp_path / "runs"}'
dataset = 'dataset.toml'
epochs = 50
micro_batch_size_per_gpu = 2
pipeline_stages = 1
gradient_accumulation_steps = 4
gradient_clipping = 0.5
warmup_steps = 20
lr_scheduler = 'cosine'
save_every_n_steps = 100
activation_checkpointing = true
[model]
type = 'flux'
diffusers_path = '{flux}'
dtype = 'bfloat16'
timestep_sample_method = 'logit_normal'
[adapter]
type = 'lora'
rank = 16
alpha = 8
dropout = 0.1
[optimizer]
type = 'adamw_optimi'
lr = 1e-4
betas = [0.9, 0.99]
weight_decay = 0.01
eps = 1e-8
[monitoring]
enable_wandb = true
wandb_tracker_name = 'my-loras'
wandb_api_key = 'secret'
""",
        f"""
resolutions = [[1280, 720]]
enable_ar_bucket = true
min_ar = 0.25
max_ar = 3.0
[[directory]]
path = '{images}'
num_repeats = 1
""",
    )
    conversion = convert_file(path)
    assert conversion.tool == "diffusion-pipe"
    assert values(conversion) == {
        "model.family": "diffusion",
        "run.output_dir": str(tmp_path / "runs"),
        "deepspeed.precision": "bf16",
        "model.path": str(flux),
        "model.diffusion.timestep_sampling": "logit_normal",
        "model.diffusion.shift": 1.0,  # diffusion-pipe shifts only when [model] shift is set
        "model.lora.r": 16,
        "model.lora.alpha": 8.0,
        "model.lora.dropout": 0.1,
        "train.lr": 1e-4,
        "train.adam_beta1": 0.9,
        "train.adam_beta2": 0.99,
        "train.weight_decay": 0.01,
        "train.adam_eps": 1e-8,
        "logging.wandb": True,
        "logging.wandb_project": "my-loras",
        "train.epochs": 50.0,
        "train.micro_batch_size": 2,
        "train.gradient_accumulation_steps": 4,
        "train.grad_clip": 0.5,
        "train.warmup_steps": 20,
        "train.schedule": "cosine",
        "train.min_lr_ratio": 1e-6 / 1e-4,  # diffusion-pipe's cosine ends at eta_min 1e-6 (train.py:855)
        "train.save_every": 100,
        "model.gradient_checkpointing": True,
        "deepspeed.zero_stage": 2,
        "data.images.resolution": 960,  # the area of 1280 x 720
        "data.images.bucket_step": 32,
        "data.images.bucketing": True,
        "data.images.max_aspect": 4.0,  # 1 / min_ar wins over max_ar
        "data.path": str(images),
    }
    assert conversion.links == {} and conversion.blocking == []
    # The API key is never copied into a config file.
    assert "secret" not in conversion.to_yaml()
    assert "WANDB_API_KEY" in unmapped(conversion)["monitoring.wandb_api_key"]


def test_every_mapped_key_has_a_comment_and_the_yaml_validates(tmp_path):
    flux = pipeline_dir(tmp_path)
    images = image_dir(tmp_path, "photos")
    path = write(
        tmp_path,
        f"dataset = 'dataset.toml'\nmax_steps = 5\n[model]\ntype = 'flux'\ndiffusers_path = '{flux}'\ndtype = 'float32'\n",
        f"resolutions = [512]\n[[directory]]\npath = '{images}'\n",
    )
    text = convert_file(path).to_yaml("out.yaml")
    assert text.startswith("# Converted by `zeropipe convert` from the diffusion-pipe config")
    assert "# Run it:  zeropipe train out.yaml" in text
    leaves = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#") and not line.rstrip().endswith(":")]
    assert leaves and all("  # " in line for line in leaves), leaves
    raw = yaml.safe_load(text)
    raw["run"] = {"name": "x"}
    config = validate_config(raw)
    assert config.model.family == "diffusion" and config.data.images.resolution == 512 and config.deepspeed.precision == "fp32"
    # No [adapter] table: a full fine-tune, said so.
    assert "  lora: null  # no [adapter] table: a full fine-tune" in text


def test_pipeline_stages_and_block_swap_become_zero3_and_offload_with_reasons(tmp_path):
    flux = pipeline_dir(tmp_path)
    images = image_dir(tmp_path, "photos")
    path = write(
        tmp_path,
        f"dataset = 'dataset.toml'\npipeline_stages = 2\nblocks_to_swap = 20\n[model]\ntype = 'flux'\ndiffusers_path = '{flux}'\ndtype = 'bfloat16'\n",
        f"[[directory]]\npath = '{images}'\n",
    )
    conversion = convert_file(path)
    assert values(conversion)["deepspeed.zero_stage"] == 3
    assert values(conversion)["deepspeed.offload_param"] == "cpu"
    why = unmapped(conversion)
    assert "ZeRO-3 (deepspeed.zero_stage: 3) shards the parameters across the GPUs" in why["pipeline_stages"]
    assert "deepspeed.offload_param: cpu keeps all parameters in host RAM" in why["blocks_to_swap"]

    stages_only = write(
        tmp_path,
        f"dataset = 'dataset.toml'\npipeline_stages = 4\n[model]\ntype = 'flux'\ndiffusers_path = '{flux}'\n",
        f"[[directory]]\npath = '{images}'\n",
        name="stages.toml",
    )
    conversion = convert_file(stages_only)
    assert values(conversion)["deepspeed.zero_stage"] == 3 and "deepspeed.offload_param" not in values(conversion)


def test_several_directories_and_repeats_become_kohya_links(tmp_path):
    flux = pipeline_dir(tmp_path)
    style = image_dir(tmp_path / "data", "style")
    subject = image_dir(tmp_path / "data", "subject", images=3, captions=False, videos=2)
    other_subject = image_dir(tmp_path / "other", "subject")
    path = write(
        tmp_path,
        f"dataset = 'dataset.toml'\n[model]\ntype = 'flux'\ndiffusers_path = '{flux}'\n",
        f"""
frame_buckets = [1, 33]
[[directory]]
path = '{style}'
num_repeats = 1
[[directory]]
path = '{subject}'
num_repeats = 5
mask_path = '/masks'
resolutions = [256]
[[directory]]
path = '{other_subject}'
num_repeats = 2
""",
    )
    conversion = convert_file(path)
    links_dir = tmp_path / "dataset.zeropipe-images"
    assert values(conversion)["data.path"] == str(links_dir)
    # Same folder names get distinct concept names; repeats go into the kohya prefix.
    assert conversion.links == {"1_style": style, "5_subject": subject, "2_subject-2": other_subject}
    why = unmapped(conversion)
    assert "masked loss is not supported" in why["dataset.directory[1].mask_path"]
    assert "per-directory settings are not supported" in why["dataset.directory[1].resolutions"]
    assert "2 video file(s)" in why["dataset.directory[1] (videos)"]
    assert "3 image(s)" in why["dataset.directory[1] (captions)"] and "concept name 'subject'" in why["dataset.directory[1] (captions)"]
    assert "this is an image model" in why["dataset.frame_buckets"]

    assert len(write_links(conversion)) == 3
    assert {link.name: link.resolve() for link in links_dir.iterdir()} == conversion.links
    # Converting again is idempotent; a directory dropped from the dataset loses its link.
    assert write_links(conversion) == []
    conversion.links.pop("2_subject-2")
    write_links(conversion)
    assert sorted(link.name for link in links_dir.iterdir()) == ["1_style", "5_subject"]


def test_a_wan22_expert_config_maps_its_video_keys_and_validates(tmp_path):
    """diffusion-pipe's Wan keys: frame_buckets, video_clip_mode, the expert's transformer_path and min_t/max_t."""
    clips = image_dir(tmp_path, "clips", images=1, videos=2)
    wan = pipeline_dir(tmp_path, "Wan2.2-T2V-A14B-Diffusers")
    (wan / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    comfy = tmp_path / "wan2.2_t2v_low_noise_14B_fp16.safetensors"
    comfy.write_bytes(b"weights")
    path = write(
        tmp_path,
        "dataset = 'dataset.toml'\nvideo_clip_mode = 'single_middle'\nimage_micro_batch_size_per_gpu = 4\n"
        f"[model]\ntype = 'wan'\nckpt_path = '{wan}'\ntransformer_path = '{comfy}'\nllm_path = '/models/umt5_xxl_fp16.safetensors'\n"
        "dtype = 'bfloat16'\nmin_t = 0\nmax_t = 0.875\n[adapter]\ntype = 'lora'\nrank = 32\n",
        f"resolutions = [512]\nframe_buckets = [33]\n[[directory]]\npath = '{clips}'\n",
    )
    conversion = convert_file(path)
    assert conversion.blocking == []
    got = values(conversion)
    assert got["model.path"] == str(wan) and got["model.diffusion.expert"] == "low_noise" and got["model.diffusion.denoiser_file"] == str(comfy)
    assert (got["model.diffusion.min_t"], got["model.diffusion.max_t"]) == (0.0, 0.875)
    # diffusion-pipe always has the image bucket; its clip modes have ZeRO-Pipe names.
    assert got["data.video.frame_buckets"] == [1, 33] and got["data.video.clip_mode"] == "middle"
    assert got["data.path"] == str(clips) and got["deepspeed.precision"] == "bf16"
    why = unmapped(conversion)
    assert not any("(videos)" in key for key in why)  # the clips train
    assert "dropped by diffusion-pipe" in why["dataset.frame_buckets (short videos)"]
    assert "one micro-batch size" in why["image_micro_batch_size_per_gpu"]
    assert "text encoders come from the diffusers pipeline folder" in why["model.llm_path"]
    config = validate_config(yaml.safe_load(conversion.to_yaml()))
    assert config.data.video.frame_buckets == [1, 33] and config.model.diffusion.expert == "low_noise"


def test_a_wan_original_checkpoint_folder_points_at_its_diffusers_release(tmp_path):
    clips = image_dir(tmp_path, "clips", videos=1)
    wan = tmp_path / "Wan2.1-T2V-1.3B"
    wan.mkdir()
    path = write(
        tmp_path,
        f"dataset = 'dataset.toml'\nvideo_clip_mode = 'multiple_overlapping'\n[model]\ntype = 'wan'\nckpt_path = '{wan}'\ntransformer_dtype = 'float8'\n",
        f"[[directory]]\npath = '{clips}'\n",
    )
    conversion = convert_file(path)
    assert conversion.blocking == []
    got = values(conversion)
    assert got["data.video.frame_buckets"] == [1] and got["data.video.clip_mode"] == "multiple"  # diffusion-pipe's default buckets: images only
    why = unmapped(conversion)
    assert "Wan-AI/Wan2.1-T2V-1.3B-Diffusers" in why["model.ckpt_path"]
    # No [adapter]: a full fine-tune, which cannot update fp8 weights; the base stays in deepspeed.precision, said so.
    assert "trains adapters only" in why["model.transformer_dtype"] and "model.quantization.format" not in got


@pytest.mark.parametrize(("stored", "format"), [("float8", "fp8"), ("float8_e5m2", "fp8_e5m2")])
def test_a_float8_transformer_dtype_with_an_adapter_keeps_the_fp8_base(tmp_path, stored, format):
    clips = image_dir(tmp_path, "clips", videos=1)
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    (tmp_path / "pipe" / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    path = write(
        tmp_path,
        f"dataset = 'dataset.toml'\n[model]\ntype = 'wan'\nckpt_path = '{pipe}'\ntransformer_dtype = '{stored}'\n[adapter]\ntype = 'lora'\nrank = 8\n",
        f"[[directory]]\npath = '{clips}'\n",
    )
    conversion = convert_file(path)
    got = values(conversion)
    assert got["model.quantization.format"] == format and got["model.lora.r"] == 8
    assert validate_config(yaml.safe_load(conversion.to_yaml())).model.quantization.storage == format
    nf4 = write(tmp_path, f"dataset = 'dataset.toml'\n[model]\ntype = 'wan'\nckpt_path = '{pipe}'\ntransformer_dtype = 'nf4'\n[adapter]\nrank = 8\n", f"[[directory]]\npath = '{clips}'\n")
    got = values(convert_file(nf4))
    assert got["model.quantization.format"] == "nf4" and got["deepspeed.zero_stage"] == 2  # bitsandbytes' nf4 base, held by every rank
    swapped = write(
        tmp_path, f"dataset = 'dataset.toml'\nblocks_to_swap = 8\n[model]\ntype = 'wan'\nckpt_path = '{pipe}'\ntransformer_dtype = 'nf4'\n[adapter]\nrank = 8\n",
        f"[[directory]]\npath = '{clips}'\n",
    )
    conversion = convert_file(swapped)
    assert values(conversion)["model.quantization.format"] == "fp8" and "cannot partition an nf4 base" in conversion.entries["model.quantization.format"].comment


def test_sdxl_single_file_checkpoint_says_how_to_make_a_pipeline_folder(tmp_path):
    checkpoint = tmp_path / "sd_xl_base_1.0.safetensors"
    checkpoint.write_bytes(b"weights")
    images = image_dir(tmp_path, "photos")
    path = write(
        tmp_path,
        f"dataset = 'dataset.toml'\n[model]\ntype = 'sdxl'\ncheckpoint_path = '{checkpoint}'\nv_pred = true\nmin_snr_gamma = 5\nunet_lr = 4e-5\ntext_encoder_1_lr = 2e-5\n"
        "[optimizer]\ntype = 'adamw_optimi'\nlr = 1e-5\n",
        f"[[directory]]\npath = '{images}'\n",
    )
    conversion = convert_file(path)
    got = values(conversion)
    assert got["model.diffusion.prediction_type"] == "v_prediction" and got["model.diffusion.min_snr_gamma"] == 5.0
    assert got["train.lr"] == 4e-5  # unet_lr: the UNet is what trains
    why = unmapped(conversion)
    assert "StableDiffusionXLPipeline.from_single_file" in why["model.checkpoint_path"]
    assert "text encoders stay frozen" in why["model.text_encoder_1_lr"]
    assert "unet_lr is used instead" in why["optimizer.lr"]


def test_unknown_keys_are_listed_never_dropped(tmp_path):
    flux = pipeline_dir(tmp_path)
    images = image_dir(tmp_path, "photos")
    path = write(
        tmp_path,
        f"dataset = 'dataset.toml'\nmy_new_option = 3\ncompile = true\n[model]\ntype = 'flux'\ndiffusers_path = '{flux}'\nflux_shift = true\n[optimizer]\ntype = 'automagic'\nlr = 1\n",
        f"cache_shuffle_num = 10\n[[directory]]\npath = '{images}'\n",
    )
    conversion = convert_file(path)
    why = unmapped(conversion)
    assert {"my_new_option", "compile", "optimizer.type", "optimizer.lr", "dataset.cache_shuffle_num"} <= set(why)
    assert "flux_shift" in conversion.entries["model.diffusion.shift"].comment  # written: a per-bucket shift, the nearest ZeRO-Pipe has
    assert "train.lr" not in values(conversion)  # automagic's lr of 1 must not become AdamW's


def test_bad_toml_and_missing_files_are_clear(tmp_path):
    broken = tmp_path / "broken.toml"
    broken.write_text("[model\ntype = 'flux'\n")
    with pytest.raises(ConversionError, match=r"broken.toml is not valid TOML: .*line 1"):
        convert_file(broken)
    no_dataset = tmp_path / "no_dataset.toml"
    no_dataset.write_text("dataset = 'missing.toml'\n[model]\ntype = 'flux'\n")
    with pytest.raises(ConversionError, match=r"dataset = 'missing.toml' not found .*fix the path"):
        convert_file(no_dataset)
    (tmp_path / "bad_dataset.toml").write_text("resolutions = [512\n")
    bad = tmp_path / "bad.toml"
    bad.write_text("dataset = 'bad_dataset.toml'\n[model]\ntype = 'flux'\n")
    with pytest.raises(ConversionError, match=r"bad_dataset.toml \(the dataset TOML\) is not valid TOML"):
        convert_file(bad)
    (tmp_path / "nodirs.toml").write_text("resolutions = [512]\n")
    nodirs = tmp_path / "nodirs_main.toml"
    nodirs.write_text("dataset = 'nodirs.toml'\n[model]\ntype = 'flux'\n")
    with pytest.raises(ConversionError, match=r"no \[\[directory\]\] entries"):
        convert_file(nodirs)
    (tmp_path / "gone.toml").write_text("[[directory]]\npath = '/no/such/folder'\n")
    gone = tmp_path / "gone_main.toml"
    gone.write_text("dataset = 'gone.toml'\n[model]\ntype = 'flux'\n")
    # People convert before copying their images: the folder is kept and listed; `zeropipe check` refuses until it exists.
    conversion = convert_file(gone)
    assert values(conversion)["data.path"] == "/no/such/folder"
    assert "not a folder on this machine" in unmapped(conversion)["dataset.directory[0].path"]


def test_a_control_path_becomes_data_control_path_for_one_folder_and_is_listed_for_several(tmp_path):
    """diffusion-pipe's edit datasets ([[directory]] control_path) map to data.control_path where data.path is that one folder."""
    edit = pipeline_dir(tmp_path, "Qwen-Image-Edit")
    (edit / "model_index.json").write_text('{"_class_name": "QwenImageEditPipeline"}')
    targets, controls = image_dir(tmp_path, "targets"), image_dir(tmp_path, "controls", captions=False)
    main = f"dataset = 'dataset.toml'\n[model]\ntype = 'qwen_image'\ndiffusers_path = '{edit}'\n"
    path = write(tmp_path, main, f"[[directory]]\npath = '{targets}'\ncontrol_path = 'controls'\n")
    conversion = convert_file(path)
    assert values(conversion)["data.path"] == str(targets)
    assert values(conversion)["data.control_path"] == str(controls)  # relative to the TOML's folder, as diffusion-pipe reads it
    assert not any("control_path" in key for key in unmapped(conversion))

    path = write(tmp_path, main, f"[[directory]]\npath = '{targets}'\ncontrol_path = '{controls}'\nnum_repeats = 3\n")
    conversion = convert_file(path)
    assert "CANNOT TRAIN YET" in unmapped(conversion)["dataset.directory[0].control_path"] or "see CANNOT TRAIN YET" in unmapped(conversion)["dataset.directory[0].control_path"]
    assert any("edit training reads one image folder and its one control folder" in reason for reason in conversion.blocking)
    assert "data.path" in values(conversion)  # the images are still named, as links with their repeats

    path = write(tmp_path, main, f"[[directory]]\npath = '{targets}'\ncontrol_path = 'missing'\n")
    assert "not a folder on this machine" in unmapped(convert_file(path))["dataset.directory[0].control_path"]


def test_control_paths_become_data_control_paths_for_a_multi_reference_edit_model(tmp_path):
    """diffusion-pipe's multi-reference edit datasets ([[directory]] control_paths, a folder per reference) map to data.control_paths, in order;
    a qwen_image type on a Qwen-Image-Edit-2509 folder (QwenImageEditPlusPipeline) trains qwen-image-edit-plus, read from its model_index.json."""
    from zeropipe.families.diffusion.entries import architecture_of

    plus = pipeline_dir(tmp_path, "Qwen-Image-Edit-2509")
    (plus / "model_index.json").write_text('{"_class_name": "QwenImageEditPlusPipeline"}')
    (plus / "transformer").mkdir()
    targets = image_dir(tmp_path, "targets")
    first, second = image_dir(tmp_path, "first", captions=False), image_dir(tmp_path, "second", captions=False)
    main = f"dataset = 'dataset.toml'\n[model]\ntype = 'qwen_image'\ndiffusers_path = '{plus}'\n"
    path = write(tmp_path, main, f"[[directory]]\npath = '{targets}'\ncontrol_paths = ['first', '{second}']\ncontrol_path = 'first'\n")
    conversion = convert_file(path)
    assert values(conversion)["data.control_paths"] == [str(first), str(second)]
    assert "data.control_path" not in values(conversion)
    assert "control_path or control_paths, not both" in unmapped(conversion)["dataset.directory[0].control_path"]
    assert architecture_of(Path(values(conversion)["model.path"])).record.name == "qwen-image-edit-plus"
