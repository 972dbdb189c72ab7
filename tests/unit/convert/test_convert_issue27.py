"""Issue 27's defects, one test each, on the peers' own example files where the issue names them (tests/fixtures/peers)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from zeropipe.cli.convert import convert_for_train
from zeropipe.config.load import validate_config
from zeropipe.convert import ConversionError, convert_file
from zeropipe.convert.diffusion_pipe import trainable_architecture

PEERS = Path(__file__).resolve().parents[2] / "fixtures" / "peers"
DP = PEERS / "diffusion-pipe" / "examples"
LF = PEERS / "llama-factory"
AXOLOTL = PEERS / "axolotl" / "examples"

# Every `model_type == '...'` of diffusion-pipe's train.py (commit 8f83dbf, the fixtures' commit), and the older
# types its users' configs still name (kandinsky5, longcat_video, hy_framepack, qwen_image21: models/ in its history).
DIFFUSION_PIPE_TRAIN_PY_TYPES = (
    "flux ltx-video hunyuan-video sdxl cosmos lumina_2 wan chroma hidream sd3 cosmos_predict2 anima omnigen2 qwen_image hunyuan_image "
    "auraflow z_image hunyuan_video_15 flux2 ernie_image ltx2 ideogram4 krea2 minimax_h3"
).split()
OURS_BY_THEIR_NAME = {"qwen_image": "qwen-image", "z_image": "z-image", "flux": "flux", "chroma": "chroma", "sdxl": "sdxl", "sd3": "sd3", "flux2": "flux2",
                      "wan": "wan", "hunyuan-video": "hunyuan-video", "ltx-video": "ltx-video", "lumina_2": "lumina2", "hidream": "hidream",
                      "auraflow": "auraflow", "hunyuan_image": "hunyuan-image"}


def values(conversion) -> dict:
    return {key: entry.value for key, entry in conversion.entries.items()}


def unmapped(conversion) -> dict:
    return dict(conversion.unmapped)


def images(root: Path, name: str) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "0.png").write_bytes(b"png")
    (folder / "0.txt").write_text("a caption")
    return folder


def pipeline(root: Path, name: str, cls: str) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "model_index.json").write_text(f'{{"_class_name": "{cls}"}}')
    return folder


def peer_main(tmp_path: Path, example: str, dataset: str, **model_paths: str) -> Path:
    """A diffusion-pipe example as its user has it: their dataset TOML and model folder in place of the example's placeholders."""
    text = (DP / example).read_text()
    text = re.sub(r"(?m)^dataset = .*$", f"dataset = '{dataset}'", text)
    for key, value in model_paths.items():
        text = re.sub(rf"(?m)^{key} = .*$", f"{key} = '{value}'", text)
    path = tmp_path / example
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------------------ defect 1
def test_every_diffusion_pipe_model_type_is_mapped_or_named_as_not_trained():
    from zeropipe.convert.diffusion_pipe import DIFFUSION_PIPE_TYPES

    assert set(DIFFUSION_PIPE_TRAIN_PY_TYPES) <= set(DIFFUSION_PIPE_TYPES)
    for theirs, ours in OURS_BY_THEIR_NAME.items():
        assert trainable_architecture(theirs) == ours, theirs
    assert trainable_architecture("omnigen2") is None and trainable_architecture("qwen-image") == "qwen-image"


def test_diffusion_pipes_own_qwen_image_example_trains_as_converted(tmp_path):
    """examples/qwen_image_24gb_vram.toml: `zeropipe train FILE` used to refuse type 'qwen_image' while its converted YAML trained."""
    folder = images(tmp_path, "imgs")
    (tmp_path / "dataset.toml").write_text(f"resolutions = [512]\n[[directory]]\npath = '{folder}'\n")
    model = pipeline(tmp_path, "Qwen-Image", "QwenImagePipeline")
    path = peer_main(tmp_path, "qwen_image_24gb_vram.toml", str(tmp_path / "dataset.toml"), diffusers_path=str(model))
    conversion = convert_file(path)
    assert conversion.blocking == [] and values(conversion)["model.path"] == str(model)
    assert any("qwen_image" in note and "qwen-image" in note for note in conversion.already)
    out = Path(convert_for_train(str(path)))
    assert out.is_file() and out.name == "qwen_image_24gb_vram.zeropipe.yaml"


@pytest.mark.parametrize(("example", "cls", "key"), [("qwen_image_24gb_vram.toml", "QwenImagePipeline", "diffusers_path"), ("wan_14b_min_vram.toml", "WanPipeline", "ckpt_path")])
def test_diffusion_pipes_float8_examples_keep_the_fp8_base(tmp_path, example, cls, key):
    """transformer_dtype = 'float8' (Qwen-Image and Wan 14B on 24 GB) converts to model.quantization: fp8 beside the LoRA, no longer listed as unsupported."""
    folder = images(tmp_path, "imgs")
    (tmp_path / "dataset.toml").write_text(f"resolutions = [512]\n[[directory]]\npath = '{folder}'\n")
    model = pipeline(tmp_path, "model", cls)
    conversion = convert_file(peer_main(tmp_path, example, str(tmp_path / "dataset.toml"), **{key: str(model)}))
    got = values(conversion)
    assert got["model.quantization.format"] == "fp8" and got["model.lora.r"]
    assert "model.transformer_dtype" not in dict(conversion.unmapped)
    assert validate_config(yaml.safe_load(conversion.to_yaml())).model.quantization.is_fp8


def test_a_type_zeropipe_does_not_train_says_which_of_diffusion_pipes_it_does(tmp_path):
    folder = images(tmp_path, "imgs")
    (tmp_path / "dataset.toml").write_text(f"[[directory]]\npath = '{folder}'\n")
    (tmp_path / "main.toml").write_text("dataset = 'dataset.toml'\n[model]\ntype = 'omnigen2'\ndiffusers_path = '/x'\n")
    conversion = convert_file(tmp_path / "main.toml")
    assert "'omnigen2'" in conversion.blocking[0] and "qwen_image" in conversion.blocking[0] and "z_image" in conversion.blocking[0]
    with pytest.raises(ConversionError, match="cannot train yet"):
        convert_for_train(str(tmp_path / "main.toml"))


def test_migrate_doc_no_longer_says_video_models_cannot_train():
    text = (Path(__file__).resolve().parents[3] / "docs" / "migrate.md").read_text()
    assert not re.search(r"(wan|hunyuan-video|ltx-video)[^.\n]*(cannot|does not) train", text, re.IGNORECASE)
    for name in ("qwen_image", "z_image", "hunyuan-video", "ltx-video"):
        assert name in text


# ------------------------------------------------------------------------------------------------ defect 4
def test_a_regex_lora_target_of_axolotls_vision_recipes_stays_a_regex(monkeypatch):
    """It became a one-element list of that string (a module name nothing is called): `check` passed, `train` refused."""
    monkeypatch.chdir(PEERS / "axolotl")
    conversion = convert_file(AXOLOTL / "qwen2_5-vl" / "lora-7b.yaml")
    assert values(conversion)["model.lora.target_modules"] == r"model.language_model.layers.[\d]+.(mlp|cross_attn|self_attn).(up|down|gate|q|k|v|o)_proj"
    assert conversion.blocking == []


def test_double_quantization_false_turns_it_off(monkeypatch):
    """LLaMA-Factory examples/train_qlora/qwen3_lora_sft_bnb_npu.yaml."""
    monkeypatch.chdir(LF)
    conversion = convert_file(LF / "examples" / "train_qlora" / "qwen3_lora_sft_bnb_npu.yaml")
    assert values(conversion)["model.quantization.double_quant"] is False


def test_a_key_set_to_false_is_listed_not_dropped(tmp_path):
    path = tmp_path / "a.yml"
    path.write_text("base_model: x\ndatasets: []\nsome_new_switch: false\n")
    assert "some_new_switch" in unmapped(convert_file(path))


def test_dataset_wide_num_repeats_is_every_directorys_default(tmp_path):
    """diffusion-pipe's minimax_h3_dataset.toml: num_repeats = 8 at the top applies to each [[directory]]."""
    text = (DP / "minimax_h3_dataset.toml").read_text()
    videos, stills = images(tmp_path, "videos"), images(tmp_path, "stills")
    text = text.replace("'/path/to/videos'", f"'{videos}'").replace("'/path/to/images'", f"'{stills}'")
    (tmp_path / "dataset.toml").write_text(text)
    model = pipeline(tmp_path, "flux", "FluxPipeline")
    (tmp_path / "main.toml").write_text(f"dataset = 'dataset.toml'\n[model]\ntype = 'flux'\ndiffusers_path = '{model}'\n")
    conversion = convert_file(tmp_path / "main.toml")
    assert set(conversion.links) == {"8_videos", "8_stills"}


def test_edit_pairs_in_several_folders_keep_data_path_and_cannot_train(tmp_path):
    targets, controls = images(tmp_path, "t1"), images(tmp_path, "c1")
    targets2, controls2 = images(tmp_path, "t2"), images(tmp_path, "c2")
    (tmp_path / "dataset.toml").write_text(
        f"[[directory]]\npath = '{targets}'\ncontrol_path = '{controls}'\n[[directory]]\npath = '{targets2}'\ncontrol_path = '{controls2}'\n"
    )
    model = pipeline(tmp_path, "kontext", "FluxKontextPipeline")
    (tmp_path / "main.toml").write_text(f"dataset = 'dataset.toml'\n[model]\ntype = 'flux'\ndiffusers_path = '{model}'\n")
    conversion = convert_file(tmp_path / "main.toml")
    assert "data.path" in values(conversion) and conversion.blocking


def test_chroma_over_a_flux_folder_is_not_a_flux_lora_and_flux_transformer_path_is_read(tmp_path):
    folder = images(tmp_path, "imgs")
    (tmp_path / "dataset.toml").write_text(f"[[directory]]\npath = '{folder}'\n")
    flux = pipeline(tmp_path, "FLUX.1-dev", "FluxPipeline")
    (tmp_path / "chroma.toml").write_text(
        f"dataset = 'dataset.toml'\n[model]\ntype = 'chroma'\ndiffusers_path = '{flux}'\ntransformer_path = '/m/chroma-unlocked-v10.safetensors'\n"
    )
    assert any("ChromaPipeline" in reason for reason in convert_file(tmp_path / "chroma.toml").blocking)
    (tmp_path / "flux.toml").write_text(
        f"dataset = 'dataset.toml'\n[model]\ntype = 'flux'\ndiffusers_path = '{flux}'\ntransformer_path = '/m/flux-dev-de-distill.safetensors'\n"
    )
    assert values(convert_file(tmp_path / "flux.toml"))["model.diffusion.denoiser_file"] == "/m/flux-dev-de-distill.safetensors"


def test_gradient_checkpointing_offload_is_listed(tmp_path):
    path = tmp_path / "a.yml"
    path.write_text("base_model: x\ndatasets: []\ngradient_checkpointing: offload\n")
    conversion = convert_file(path)
    assert values(conversion)["model.gradient_checkpointing"] is True and "host RAM" in unmapped(conversion)["gradient_checkpointing"]


def test_llama_factory_without_lr_or_batch_trains_with_hugging_faces_defaults_and_says_so(tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text("model_name_or_path: x\nstage: sft\nfinetuning_type: lora\n")
    conversion = convert_file(path)
    assert values(conversion)["train.lr"] == 5e-5 and values(conversion)["train.micro_batch_size"] == 8
    assert "Hugging Face's default" in conversion.entries["train.lr"].comment


def test_a_hub_vlm_says_its_config_could_not_be_read(monkeypatch):
    monkeypatch.chdir(LF)
    conversion = convert_file(LF / "examples" / "train_full" / "qwen3vl_full_sft.yaml")
    assert "could not be read" in unmapped(conversion)["freeze_vision_tower"]
    assert "not a vision-language model" not in unmapped(conversion)["freeze_vision_tower"]


# ------------------------------------------------------------------------------------------------ defect 6
def test_convert_keeps_an_image_folder_that_is_not_here_yet(tmp_path):
    """diffusion-pipe's examples/main_example.toml names /home/anon/data/images/grayscale: convert, list it; `check` refuses it."""
    from zeropipe.config.load import validate_config
    from zeropipe.errors import ConfigError

    path = peer_main(tmp_path, "main_example.toml", str(DP / "dataset.toml"))
    conversion = convert_file(path)
    assert values(conversion)["data.path"] == "/home/anon/data/images/grayscale"
    assert "not a folder on this machine" in unmapped(conversion)["dataset.directory[0].path"]
    with pytest.raises(ConfigError, match="grayscale does not exist"):
        validate_config(conversion.raw())


def test_dataset_info_is_looked_up_in_the_second_base_when_the_first_has_a_data_folder_without_it(tmp_path, monkeypatch):
    (tmp_path / "cwd" / "data").mkdir(parents=True)  # a data/ folder, but not LLaMA-Factory's
    recipe = tmp_path / "recipe"
    (recipe / "data").mkdir(parents=True)
    (recipe / "data" / "dataset_info.json").write_text('{"mine": {"file_name": "mine.json"}}')
    (recipe / "data" / "mine.json").write_text('[{"instruction": "a", "input": "", "output": "b"}]')
    (recipe / "a.yaml").write_text("model_name_or_path: x\nstage: sft\ndataset: mine\n")
    monkeypatch.chdir(tmp_path / "cwd")
    assert values(convert_file(recipe / "a.yaml"))["data.path"] == str(recipe / "data" / "mine.json")


def test_the_wan_hint_names_a_release_only_from_a_release_folder(tmp_path):
    folder = images(tmp_path, "imgs")
    (tmp_path / "dataset.toml").write_text(f"[[directory]]\npath = '{folder}'\n")
    for name, expected in (("Wan2.1-T2V-14B", "Wan-AI/Wan2.1-T2V-14B-Diffusers"), ("ckpt_path", "the Wan-AI/Wan2.x-")):
        (tmp_path / "main.toml").write_text(f"dataset = 'dataset.toml'\n[model]\ntype = 'wan'\nckpt_path = '/models/{name}'\n")
        why = unmapped(convert_file(tmp_path / "main.toml"))["model.ckpt_path"]
        assert expected in why and "Wan-AI/ckpt_path" not in why


@pytest.mark.parametrize("name", ["llama3_lora_sft_awq.yaml", "llama3_lora_sft_gptq.yaml", "llama3_lora_sft_aqlm.yaml"])
def test_a_pre_quantized_base_cannot_train_and_says_what_to_use(monkeypatch, name):
    monkeypatch.chdir(LF)
    conversion = convert_file(LF / "examples" / "train_qlora" / name)
    assert any("pre-quantized" in reason and "quantization_bit: 4" in reason for reason in conversion.blocking)


def test_a_vision_recipe_with_several_datasets_says_vlm_runs_read_one_file(monkeypatch):
    """LLaMA-Factory's qwen3vl_lora_sft.yaml (mllm_demo, identity, alpaca_en_demo): no data.mixture that check then refuses for a VLM."""
    monkeypatch.chdir(LF)
    conversion = convert_file(LF / "examples" / "train_lora" / "qwen3vl_lora_sft.yaml")
    assert any("vision-language" in reason and "one data.path" in reason for reason in conversion.blocking)
