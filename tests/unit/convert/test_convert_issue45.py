"""Issue 45: the peers' defaults written, nothing trains that convert said it cannot, `check` refuses what `train` would.

Each test names the defect of the issue it covers (1-9); each failed on the main it was written against.
"""

from __future__ import annotations

import json
import math
import re
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
    from zeropipe.families.diffusion.objectives import FlowObjective

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


# ------------------------------------------------------------------------------- 2: the peers' defaults written
def test_2_diffusion_pipes_square_bucket_and_axolotls_cosine_to_zero_are_written(tmp_path):
    images = image_dir(tmp_path, "imgs")
    flux = tmp_path / "FLUX.1-dev"
    flux.mkdir()
    (flux / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    path = write(tmp_path, f"dataset = 'dataset.toml'\n[model]\ntype = 'flux'\ndiffusers_path = '{flux}'\n", f"resolutions = [512]\n[[directory]]\npath = '{images}'\n")
    entry = convert_file(path).entries["data.images.bucketing"]
    assert entry.value is False and "enable_ar_bucket" in entry.comment and "utils/dataset.py:458" in entry.comment
    axolotl = tmp_path / "a.yml"
    axolotl.write_text("base_model: x\ndatasets: []\nlearning_rate: 0.0001\n")
    entry = convert_file(axolotl).entries["train.min_lr_ratio"]
    assert entry.value == 0.0 and "lr_scheduler" in entry.comment and "training.py:144" in entry.comment
    # A file that sets its own floor keeps it.
    axolotl.write_text("base_model: x\ndatasets: []\ncosine_min_lr_ratio: 0.2\n")
    assert convert_file(axolotl).entries["train.min_lr_ratio"].value == 0.2


# ------------------------------------------------------------- 3: what convert cannot train, check and train refuse
def test_3_a_converted_chroma_file_is_refused_by_check_and_train_with_the_reason(tmp_path, monkeypatch, capsys):
    """Chroma's transformer over a FLUX.1 folder: `zeropipe check` said "no problems" and `train` trained plain FLUX.1 on main."""
    from zeropipe.cli.main import main

    monkeypatch.chdir(tmp_path)
    images = image_dir(tmp_path, "imgs")
    flux = tmp_path / "FLUX.1-dev"
    flux.mkdir()
    (flux / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    write(tmp_path, f"dataset = 'dataset.toml'\n[model]\ntype = 'chroma'\ndiffusers_path = '{flux}'\ntransformer_path = '/m/chroma-unlocked-v10.safetensors'\n"
          "[adapter]\ntype = 'lora'\nrank = 4\n", f"resolutions = [64]\n[[directory]]\npath = '{images}'\n", name="chroma.toml")
    assert main(["convert", "chroma.toml", "--out", "chroma.yaml"]) == 0
    written = yaml.safe_load((tmp_path / "chroma.yaml").read_text())
    assert "ChromaPipeline" in written["convert"]["cannot_train"][0]
    capsys.readouterr()
    assert main(["check", "chroma.yaml"]) == 1
    said = capsys.readouterr().out
    assert "ZP030" in said and "ChromaPipeline" in said
    assert main(["train", "chroma.yaml"]) == 2
    said = capsys.readouterr().err
    assert "ZP030" in said and "ChromaPipeline" in said and not (tmp_path / "runs").exists()


# ------------------------------------------------------------------- 4: axolotl data files not on this machine yet
@pytest.mark.parametrize("dataset", ["  - path: ./datasets/x.jsonl\n    type: alpaca\n", "  - ds_type: json\n    data_files: ./datasets/x.jsonl\n    type: alpaca\n"],
                         ids=["path", "data_files"])
def test_4_an_axolotl_data_file_not_here_yet_is_written_as_given_and_listed(tmp_path, dataset):
    path = tmp_path / "a.yml"
    path.write_text(f"base_model: x\ndatasets:\n{dataset}")
    conversion = convert_file(path)
    assert values(conversion)["data.path"] == str(tmp_path / "datasets" / "x.jsonl")
    why = " ".join(reason for key, reason in conversion.unmapped if key.startswith("datasets"))
    assert "not on this machine" in why and "huggingface-cli" not in why and "None" not in why


# ---------------------------------------------------------- 5: DeepSpeed JSONs with train_batch_size and no micro-batch
@pytest.mark.parametrize("name", ["cifar_ds_config.json", "Megatron-LM_scripts_ds_zero2_config.json"])
def test_5_a_json_with_train_batch_size_alone_is_not_refused_by_deepspeeds_parser(tmp_path, name):
    from zeropipe.check import check_config
    from zeropipe.launch.resolve import resolve_run

    data = tmp_path / "train.jsonl"
    data.write_text('{"instruction": "hi", "output": "yo"}\n')
    json_file = Path(__file__).resolve().parents[2] / "fixtures" / "peers" / "deepspeed" / "DeepSpeedExamples" / name
    config = validate_config({"model": {"config": {"model_type": "llama", "hidden_size": 32}}, "data": {"path": str(data)}, "hardware": {"gpus": 2},
                              "deepspeed": {"config_file": str(json_file)}})
    assert [f.render() for f in check_config(config, world_size=2, accelerator="cuda") if f.rule == "ZP009"] == []
    # ...and the run feeds the micro-batch DeepSpeed derives: train_batch_size 16 over 2 ranks, accumulation 1.
    resolved = resolve_run(config, world_size=2, accelerator="cuda", fill_auto_knobs=False)
    assert (resolved.config.train.micro_batch_size, resolved.config.train.gradient_accumulation_steps) == (8, 1)


# ------------------------------------------------------------------------------------------- 8: false messages
def test_8_warm_up_is_said_shortened_only_when_it_is(tmp_path):
    """A DeepSpeed JSON's own warm-up is not shortened by ZeRO-Pipe: the note says what the scheduler does."""
    from zeropipe.config.deepspeed import build_deepspeed_config
    from zeropipe.launch.prepare import warmup_notes
    from zeropipe.launch.resolve import resolve_run

    data = tmp_path / "train.jsonl"
    data.write_text('{"instruction": "hi", "output": "yo"}\n')
    json_file = tmp_path / "ds.json"
    json_file.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                                     "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-4, "warmup_num_steps": 10}}}))
    config = validate_config({"model": {"config": {"model_type": "llama", "hidden_size": 32}}, "data": {"path": str(data)}, "deepspeed": {"config_file": str(json_file)}})
    resolved = resolve_run(config, world_size=1, accelerator="cpu", fill_auto_knobs=False)
    ds = build_deepspeed_config(resolved.config, 1, 3, 32, user_json=resolved.user_ds_config).config
    notes = warmup_notes(resolved.config.train.warmup_steps, 3, ds, str(json_file))
    assert notes and "shortened" not in notes[0] and "never reaches its peak" in notes[0]
    # ZeRO-Pipe's own schedule is shortened, and says so.
    plain = validate_config({"model": {"config": {"model_type": "llama", "hidden_size": 32}}, "data": {"path": str(data)}, "train": {"warmup_steps": 10}})
    ds = build_deepspeed_config(plain, 1, 3, 32).config
    assert "shortened to 2" in warmup_notes(10, 3, ds, None)[0]


def test_8_llama_factory_gradient_checkpointing_and_axolotls_old_names_are_mapped(tmp_path):
    path = tmp_path / "lf.yaml"
    path.write_text("model_name_or_path: x\nstage: sft\nfinetuning_type: lora\ngradient_checkpointing: true\n")
    conversion = convert_file(path)
    assert "gradient_checkpointing" not in unmapped(conversion) and values(conversion)["model.gradient_checkpointing"] is True
    assert any(note.startswith("gradient_checkpointing: true") for note in conversion.already)
    assert "lr_scheduler_type" in conversion.entries["train.schedule"].comment and "from lr_scheduler_type" not in conversion.entries["train.schedule"].comment
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    held = tmp_path / "held.jsonl"
    held.write_text('{"instruction": "hi", "output": "yo"}\n')
    train = tmp_path / "train.jsonl"
    train.write_text('{"instruction": "hi", "output": "yo"}\n')
    axolotl = tmp_path / "dpo.yml"
    axolotl.write_text(f"base_model: x\nrl: dpo\ndpo_beta: 0.25\ndatasets:\n  - path: {data}\n    type: chatml.intel\n")
    conversion = convert_file(axolotl)
    assert values(conversion)["preference.beta"] == 0.25 and "dpo_beta" not in unmapped(conversion)
    sft = tmp_path / "sft.yml"
    sft.write_text(f"base_model: x\ndatasets:\n  - path: {train}\n    type: alpaca\ntest_datasets:\n  - path: {held}\n    type: alpaca\n")
    conversion = convert_file(sft)
    assert values(conversion)["data.eval_path"] == str(held) and "test_datasets" not in unmapped(conversion)


def test_8_diffusion_pipes_single_file_hints_name_the_files_own_model_and_resolutions_are_not_invented(tmp_path):
    images = image_dir(tmp_path, "imgs")
    for kind, expected in (("flux2", "FLUX.2"), ("z_image", "Z-Image"), ("krea2", "Krea 2")):
        path = write(tmp_path, f"dataset = 'dataset.toml'\n[model]\ntype = '{kind}'\ndiffusion_model = '/m/{kind}.safetensors'\n",
                     f"size_buckets = [[512, 512, 1]]\n[[directory]]\npath = '{images}'\n")
        conversion = convert_file(path)
        why = unmapped(conversion)
        assert expected in why["model.diffusion_model"] and "LTX" not in why["model.diffusion_model"], kind
        # No resolutions in the dataset TOML: nothing is said to come from it.
        assert "data.images.resolution" not in conversion.entries and "size_buckets" in why["dataset.resolutions"]


# ------------------------------------------------------------------- 6: check refuses what train refuses before step 1
TINY_TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 128, "vocab_size": 320}
TINY_LLAVA = {"model_type": "llava", "image_token_id": 310, "text_config": {"model_type": "llama", **TINY_TEXT},
              "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "image_size": 32, "patch_size": 8, "projection_dim": 32}}
AXOLOTL_VLM_TARGETS = r"model.language_model.layers.[\d]+.(mlp|cross_attn|self_attn).(up|down|gate|q|k|v|o)_proj"  # axolotl's qwen2_5-vl/lora-7b.yaml


def _train_refuses_targets(config):
    """What the rank does when it adds the adapters (families/vlm/model.py add_vlm_lora -> lora_module_names), on the model built on the meta device."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from zeropipe.families.vlm.model import lora_module_names, trainable_parts

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(**TINY_LLAVA))
    lora_module_names(model, config.model.lora, trainable_parts(config.model))


def _train_refuses_frames(config):
    """What the launcher does when it prepares the clips (the entry's codec, take_clips), before any rank starts."""
    from zeropipe.families.diffusion.entries import architecture_named

    architecture_named("wan").record.codec.take_clips(config, "wan", [], [])


def _train_refuses_denoiser_file(config):
    """What the rank does before loading the denoiser (diffusion/pipelines.py single_file_renamer)."""
    from zeropipe.families.diffusion.entries import architecture_named
    from zeropipe.families.diffusion.pipelines import single_file_renamer

    single_file_renamer(architecture_named("wan").record.denoiser_class, Path(config.model.diffusion.denoiser_file))


# Every refusal `zeropipe train` makes after `check` and before the first step that a config alone decides (issue 45, item 6).
REFUSED_BEFORE_THE_FIRST_STEP = {
    "targets": ({"model": {"config": TINY_LLAVA, "lora": {"r": 4, "target_modules": AXOLOTL_VLM_TARGETS}}, "data": {"synthetic": {"task": "shapes"}}},
                "model.lora.target_modules", _train_refuses_targets),
    "frames": ({"model": {"config": {"pipeline": "tiny-wan"}}, "data": {"synthetic": {"task": "shapes"}, "video": {"frame_buckets": [1, 87]}}},
               "data.video.frame_buckets", _train_refuses_frames),
    "files": ({"model": {"config": {"pipeline": "tiny-wan"}, "diffusion": {"denoiser_file": "/nonexistent/wan2.1_t2v_1.3B_bf16.safetensors"}},
               "data": {"synthetic": {"task": "shapes"}}}, "model.diffusion.denoiser_file", _train_refuses_denoiser_file),
}


@pytest.mark.parametrize("case", list(REFUSED_BEFORE_THE_FIRST_STEP))
def test_6_check_refuses_what_train_refuses_before_the_first_step(case):
    from zeropipe.check import check_config
    from zeropipe.errors import ConfigError

    raw, key, train_step = REFUSED_BEFORE_THE_FIRST_STEP[case]
    config = validate_config(raw)
    with pytest.raises(ConfigError) as refused:
        train_step(config)
    assert key in [problem_key for problem_key, _ in refused.value.problems]
    errors = [f for f in check_config(config, world_size=1, accelerator="cpu") if f.severity == "error"]
    assert key in [f.key for f in errors], [f.render() for f in errors]


def test_6_an_axolotl_vlm_recipe_adapts_the_language_model_it_names(tmp_path):
    """axolotl's Qwen2.5-VL LoRA recipe names the language model's layers only: model.trainable says so, and check passes it."""
    from zeropipe.check import check_config

    path = tmp_path / "vl.yml"
    path.write_text(f"base_model: x\nadapter: lora\nlora_r: 4\nlora_target_modules: '{AXOLOTL_VLM_TARGETS}'\ndatasets: []\n")
    entry = convert_file(path).entries["model.trainable"]
    assert entry.value == ["language_model"] and "lora_target_modules" in entry.comment
    config = validate_config({"model": {"config": TINY_LLAVA, "lora": {"r": 4, "target_modules": AXOLOTL_VLM_TARGETS}, "trainable": entry.value},
                              "data": {"synthetic": {"task": "shapes"}}})
    assert [f.render() for f in check_config(config, world_size=1, accelerator="cpu") if f.severity == "error"] == []


# --------------------------------------------------------------- 7: Qwen-Image-Edit's end-of-run samples in bf16
@pytest.mark.parametrize("preset", ["tiny-qwen-image-edit", "tiny-qwen-image-edit-plus"])
def test_7_qwen_image_edit_samples_in_bf16_beside_a_float32_vae(tmp_path, preset):
    """As the run's samples are drawn (families/diffusion/task.py sample_images): the trained denoiser and the prompts in bf16, the VAE
    in float32 (sampling_vae). Main failed in the VAE: "Input type (c10::BFloat16) and bias type (float) should be the same"."""
    from PIL import Image

    from zeropipe.families.diffusion.pipelines import build_tiny_pipeline

    arch = build_tiny_pipeline({"pipeline": preset}, tmp_path / "pipeline", seed=2)
    pipeline = arch.pipeline().from_pretrained(str(tmp_path / "pipeline"), processor=None)
    pipeline.transformer.to(torch.bfloat16)
    assert pipeline.vae.dtype == torch.float32
    pipeline.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(0)
    dim = pipeline.transformer.config.joint_attention_dim
    condition = {"prompt_embeds": torch.randn(1, 5, dim, generator=generator).bfloat16(), "prompt_embeds_mask": torch.ones(1, 5, dtype=torch.long)}
    negative = {"prompt_embeds": torch.randn(1, 5, dim, generator=generator).bfloat16(), "prompt_embeds_mask": torch.ones(1, 5, dtype=torch.long)}
    image = Image.new("RGB", (32, 32), (200, 40, 40))
    kwargs = {"height": 32, "width": 32, "num_inference_steps": 1, "output_type": "latent", "return_dict": False,
              "generator": torch.Generator().manual_seed(5), "image": image if preset == "tiny-qwen-image-edit" else [image],
              **arch.sampling.sample_kwargs(condition, negative, 1.0, 1.0)}
    with torch.no_grad():
        latents = arch.sampling.draw(pipeline, kwargs)
    assert latents.dtype == torch.bfloat16 and torch.isfinite(latents.float()).all()


# ------------------------------------------------------------------------------- the rule, over every converter
from tests.unit.convert.test_peer_configs import PEERS, ROOTS, SOURCES, leaves, outcome  # noqa: E402
from zeropipe.convert import ConversionError, read_source  # noqa: E402
from zeropipe.convert import axolotl as axolotl_converter  # noqa: E402
from zeropipe.convert import diffusion_pipe as diffusion_pipe_converter  # noqa: E402
from zeropipe.convert import llama_factory as llama_factory_converter  # noqa: E402

CONVERTERS = {"diffusion-pipe": diffusion_pipe_converter, "axolotl": axolotl_converter, "llama-factory": llama_factory_converter}


def _applies(peer, conversion, source: dict, tool: str, flat: dict) -> bool:
    if peer.applies.startswith("unless "):
        return peer.applies.removeprefix("unless ") not in flat
    if peer.applies == "lora":
        return "model.lora.r" in conversion.entries
    if peer.applies == "vlm":
        return "model.trainable" in conversion.entries or any(key.startswith("freeze_") for key, _ in conversion.unmapped)
    if tool == "diffusion-pipe" and peer.applies in ("flow", "video"):
        from zeropipe.families.diffusion.entries import architectures

        model = source.get("model") or {}
        arch = architectures().get(diffusion_pipe_converter.model_architecture(str(model.get("type")), model) or "")
        if arch is None:
            return False
        return arch.record.objective == "flow" if peer.applies == "flow" else arch.record.video
    return True


def _given(peer, flat: dict) -> bool:
    key = peer.key.removeprefix("model.") if peer.key.startswith("model.") else peer.key
    names = {peer.key, key, peer.key.split(".")[-1]}
    return any(name in flat or any(k.endswith("." + name) for k in flat) for name in names)


def test_every_converter_declares_only_defaults_that_differ_from_zeropipes_and_cites_the_peers_source():
    from zeropipe.config.schema import RunConfig

    defaults = RunConfig.model_validate({}).model_dump()
    for tool, module in CONVERTERS.items():
        assert module.PEER_DEFAULTS, tool
        for name, peer in module.PEER_DEFAULTS.items():
            assert re.search(r"\.py:\d+", peer.source), f"{tool} {name}: cite the peer's file and line"
            node = defaults
            for part in peer.target.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            ours = peer.written if peer.written is not None else peer.value
            if isinstance(ours, (int, float, bool)) and node is not None:
                assert node != ours, f"{tool} {name}: {ours!r} is ZeRO-Pipe's default too: nothing to write"


# Users' configs from public repositories (tests/fixtures/peers/users/README.md names each source and commit).
USERS = PEERS / "users"
USER_SOURCES = [("diffusion-pipe", f) for f in sorted(USERS.glob("diffusion-pipe/*/*.toml")) if "[model]" in f.read_text()]


@pytest.mark.parametrize(("tool", "path"), SOURCES, ids=[str(path.relative_to(PEERS)) for _, path in SOURCES])
def test_the_rule_each_key_and_each_differing_default_is_written_listed_or_refused(tool, path, monkeypatch):
    """Issue 45's rule on every peer config: the source keys are accounted for (test_peer_configs' contract), and each default of the peer
    that differs from ZeRO-Pipe's and that the file leaves out ends in exactly one of: written (the comment cites the peer's source), listed,
    or a refusal. A key ZeRO-Pipe has an equivalent for is never listed as having none."""
    hold_to_the_rule(tool, path, monkeypatch)


@pytest.mark.parametrize(("tool", "path"), USER_SOURCES, ids=[str(path.relative_to(USERS)) for _, path in USER_SOURCES])
def test_the_rule_holds_on_users_configs(tool, path, tmp_path, monkeypatch):
    """The same rule on users' configs (Wan 2.2 experts, Qwen-Image(-Edit), FLUX.2 klein with edit pairs, Z-Image, HunyuanVideo, Krea 2).
    They name their dataset TOML by an absolute path of their machine (/workspace/...): it is read from beside the file instead."""
    import shutil

    text = path.read_text()
    named = re.search(r"^dataset\s*=\s*'([^']+)'", text, re.M)
    local = tmp_path / path.name
    if named:
        dataset = Path(named[1]).name
        shutil.copy(path.parent / dataset, tmp_path / dataset)
        text = text.replace(named[0], f"dataset = '{dataset}'")
    local.write_text(text)
    monkeypatch.setitem(ROOTS, tool, tmp_path)
    hold_to_the_rule(tool, local, monkeypatch)


def hold_to_the_rule(tool: str, path: Path, monkeypatch) -> None:
    kind, why = outcome(tool, path, monkeypatch)
    assert kind in ("converted", "refused"), f"{kind}: {why}"
    try:
        conversion = convert_file(path, links_dir=Path("/nonexistent-links"))
    except ConversionError:
        return
    if conversion.blocking:
        return
    source = read_source(path)
    flat = leaves(source)
    if tool == "diffusion-pipe":
        dataset = Path(str(source.get("dataset")))
        dataset = dataset if dataset.is_absolute() else ROOTS[tool] / dataset
        if dataset.is_file():
            flat.update({f"dataset.{key}": value for key, value in leaves(read_source(dataset)).items()})
    listed = {key for key, _ in conversion.unmapped}
    for name, peer in CONVERTERS[tool].PEER_DEFAULTS.items():
        if _given(peer, flat) or not _applies(peer, conversion, source, tool, flat):
            continue
        entry = conversion.entries.get(peer.target)
        written = entry is not None and peer.source in entry.comment
        is_listed = peer.key in listed
        assert written != is_listed, f"{name}: the file leaves {peer.key} out ({tool}'s default {peer.value!r}): " + (
            "written and listed both" if written else f"neither written ({entry}) nor listed")
    equivalents = {peer.key.split(".")[-1] for module in CONVERTERS.values() for peer in module.PEER_DEFAULTS.values()} | {
        "shift", "gradient_checkpointing", "dpo_beta", "test_datasets", "sigmoid_scale", "flux_shift", "lr_scheduler_eta_min"}
    wrong = [key for key, reason in conversion.unmapped if key.split(".")[-1] in equivalents and "no ZeRO-Pipe equivalent" in reason]
    assert not wrong, f"listed as having no equivalent, though mapped elsewhere: {wrong}"


def test_3_a_flux2_klein_file_with_several_control_folders_carries_its_verdict(tmp_path):
    """A user's FLUX.2 klein file with edit pairs in several [[directory]] entries: converted with the verdict in convert.cannot_train (ZP030)."""
    import shutil

    source = USERS / "diffusion-pipe" / "jalberty2018-run-diffusion-pipe"
    shutil.copy(source / "dataset-control-target.toml", tmp_path)
    text = (source / "Flux_Klein_9B_config.toml").read_text().replace("dataset = '/workspace/dataset-control-target.toml'", "dataset = 'dataset-control-target.toml'")
    (tmp_path / "klein.toml").write_text(text)
    raw = convert_file(tmp_path / "klein.toml", links_dir=tmp_path / "links").raw()
    assert "control_path" in raw["convert"]["cannot_train"][0] and raw["convert"]["tool"] == "diffusion-pipe"


def test_8_a_control_folder_on_a_plain_flux_folder_names_the_kontext_pipeline(tmp_path):
    """A FLUX.1 Kontext file (control_path) over a FLUX.1 folder: the refusal names the Kontext pipeline its own listing names, not only Qwen's."""
    from zeropipe.families.diffusion.parts import PART_SETTINGS

    config = validate_config({"model": {"config": {"pipeline": "tiny-flux"}}, "data": {"synthetic": {"task": "shapes"}, "control_path": str(tmp_path)}})
    from zeropipe.families.diffusion.entries import architecture_named

    key, message = PART_SETTINGS["data.control_path"](config, architecture_named("flux"))
    assert key == "data.control_path" and "FluxKontextPipeline" in message and "flux-kontext" in message
