"""Vision-language models: which parameters each part owns, what trains, LoRA's targets, configs and the planner."""

from __future__ import annotations

import pytest
import torch

from zeropipe.config.schema import ModelSection, RunConfig
from zeropipe.errors import ConfigError
from zeropipe.families.vlm.model import (
    build_vlm,
    check_trainable,
    lora_module_names,
    part_counts,
    part_of,
    part_prefixes,
    resolve_inline_config,
    vlm_config,
)

TINY_TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 128, "vocab_size": 320}
TINY_LLAVA = {
    "model_type": "llava",
    "image_token_id": 310,
    "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "image_size": 32, "patch_size": 8, "projection_dim": 32},
    "text_config": {"model_type": "llama", **TINY_TEXT},
}
TINY_GEMMA3 = {
    "model_type": "gemma3",
    "mm_tokens_per_image": 4,
    "image_token_id": 310,
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "image_size": 32, "patch_size": 8, "vision_use_head": False},
    "text_config": {**TINY_TEXT, "head_dim": 8, "sliding_window": 32},
}
TINY_QWEN2_VL = {
    "model_type": "qwen2_vl",
    "image_token_id": 310,
    "vision_config": {"depth": 2, "embed_dim": 32, "hidden_size": 32, "num_heads": 4, "mlp_ratio": 2, "patch_size": 8, "spatial_merge_size": 2},
    "text_config": {**TINY_TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}},
}
TINY_IDEFICS3 = {
    "model_type": "idefics3",
    "image_token_id": 310,
    "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "image_size": 32, "patch_size": 8},
    "text_config": {"model_type": "llama", **TINY_TEXT},
}
LM = ["lm_head", "model.language_model"]
TEXT_MODEL = ["lm_head", "model.text_model"]


def section(config: dict, **fields) -> ModelSection:
    return ModelSection.model_validate({"config": config, **fields})


def meta_model(config: dict):
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(vlm_config(section(config)))


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (TINY_LLAVA, {"vision_tower": ["model.vision_tower"], "projector": ["model.multi_modal_projector"], "language_model": LM}),
        (TINY_GEMMA3, {"vision_tower": ["model.vision_tower"], "projector": ["model.multi_modal_projector"], "language_model": LM}),
        # Qwen2-VL's projector (merger) sits inside its vision module.
        (TINY_QWEN2_VL, {"vision_tower": ["model.visual"], "projector": ["model.visual.merger"], "language_model": LM}),
        (TINY_IDEFICS3, {"vision_tower": ["model.vision_model"], "projector": ["model.connector"], "language_model": TEXT_MODEL}),
    ],
    ids=["llava", "gemma3", "qwen2_vl", "idefics3"],
)
def test_parts_resolve_to_the_architectures_module_names(config, expected):
    model = meta_model(config)
    prefixes = part_prefixes(model)
    # Gemma 3 ties lm_head to the embeddings, so parameters() lists it once, under the embeddings.
    if config["model_type"] == "gemma3":
        expected = {**expected, "language_model": ["model.language_model"]}
    assert prefixes == expected
    total = sum(p.numel() for p in model.parameters())
    assert sum(c["total"] for c in part_counts(model).values()) == total


def test_part_of_ignores_peft_prefixes_and_prefers_the_deepest_name():
    assert part_of("base_model.model.model.vision_tower.encoder.layers.0.self_attn.q_proj.lora_A.default.weight") == "vision_tower"
    assert part_of("model.visual.merger.mlp.0.weight") == "projector"
    assert part_of("model.something_else.weight") is None


def test_unknown_parameters_are_an_error_not_silently_frozen():
    model = meta_model(TINY_LLAVA)
    model.register_parameter("extra_scale", torch.nn.Parameter(torch.ones(1, device="meta")))
    with pytest.raises(ConfigError, match="extra_scale"):
        part_prefixes(model)


def test_frozen_parts_have_no_trainable_parameters():
    model = build_vlm(section(TINY_LLAVA, trainable=["projector"]), vlm_config(section(TINY_LLAVA)), "fp32")
    counts = part_counts(model)
    assert counts["projector"]["trainable"] == counts["projector"]["total"] > 0
    assert counts["vision_tower"]["trainable"] == counts["language_model"]["trainable"] == 0
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(name.startswith("model.multi_modal_projector.") for name in trainable)


def test_default_trains_projector_and_language_model():
    counts = check_trainable(section(TINY_LLAVA), vlm_config(section(TINY_LLAVA)))
    assert counts["vision_tower"]["trainable"] == 0
    assert counts["projector"]["trainable"] == counts["projector"]["total"]
    assert counts["language_model"]["trainable"] == counts["language_model"]["total"]


def test_empty_trainable_is_refused():
    with pytest.raises(ConfigError, match="model.trainable"):
        check_trainable(section(TINY_LLAVA, trainable=[]), vlm_config(section(TINY_LLAVA)))


def test_lora_targets_stay_within_the_chosen_parts():
    model = meta_model(TINY_LLAVA)
    lora = ModelSection.model_validate({"lora": {"r": 4}}).lora
    names = lora_module_names(model, lora, ("language_model",))
    assert names and all(n.startswith("model.language_model.") for n in names)
    assert {n.rsplit(".", 1)[-1] for n in names} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    # The vision tower's attention output is out_proj; the projector's linear layers all count.
    vision = lora_module_names(model, lora, ("vision_tower", "projector"))
    assert {n.rsplit(".", 1)[-1] for n in vision} == {"q_proj", "k_proj", "v_proj", "out_proj", "linear_1", "linear_2"}
    explicit = ModelSection.model_validate({"lora": {"target_modules": ["fc1"]}}).lora
    with pytest.raises(ConfigError, match="match no linear layer of the language_model; its linear layers are: .*q_proj"):
        lora_module_names(model, explicit, ("language_model",))


def test_lora_model_trains_adapters_of_the_chosen_parts_only():
    config = section(TINY_LLAVA, trainable=["language_model"], lora={"r": 4, "target_modules": ["q_proj", "v_proj"]})
    model = build_vlm(config, vlm_config(config), "fp32")
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name and ".language_model." in name for name in trainable)
    # Per layer: q_proj 32->32 and v_proj 32->16 adapters of rank 4.
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 2 * ((4 * 32 + 32 * 4) + (4 * 32 + 16 * 4))


def test_gemma3_projector_cannot_take_lora_and_says_what_to_do():
    config = section(TINY_GEMMA3, lora={"r": 4})
    with pytest.raises(ConfigError, match="projector of Gemma3ForConditionalGeneration has no linear layer for LoRA"):
        check_trainable(config, vlm_config(config))
    config = section(TINY_GEMMA3, trainable=["language_model"], lora={"r": 4})
    assert check_trainable(config, vlm_config(config))["language_model"]["trainable"] > 0


def test_inline_config_takes_vocabulary_and_token_ids_from_the_tokenizer(tmp_path):
    from zeropipe.families.vlm.model import build_processor

    fields = {k: v for k, v in TINY_LLAVA.items() if k != "image_token_id"}
    fields["text_config"] = {k: v for k, v in fields["text_config"].items() if k != "vocab_size"}
    processor = build_processor(fields, ["a red circle on a blue background"] * 20, 300, tmp_path)
    tokenizer = processor.tokenizer
    resolved = resolve_inline_config(fields, tokenizer)
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    assert image_id == len(tokenizer) - 1  # added after the BPE vocabulary
    assert resolved.fields["text_config"]["vocab_size"] == len(tokenizer)
    assert resolved.fields["image_token_id"] == image_id
    assert resolved.fields["text_config"]["eos_token_id"] == tokenizer.eos_token_id
    with pytest.raises(ConfigError, match=rf"model.config.image_token_id: is 5 but the tokenizer's <image> is {image_id}"):
        resolve_inline_config({**fields, "image_token_id": 5}, tokenizer)
    with pytest.raises(ConfigError, match="model.config.text_config.vocab_size"):
        resolve_inline_config({**fields, "text_config": {**fields["text_config"], "vocab_size": 100}}, tokenizer)


def test_gemma3_token_grid_must_divide_the_patch_grid(tmp_path):
    from zeropipe.families.vlm.model import build_processor

    fields = {k: v for k, v in TINY_GEMMA3.items() if k != "image_token_id"}
    processor = build_processor(fields, ["a red circle"] * 20, 300, tmp_path)
    with pytest.raises(ConfigError, match="mm_tokens_per_image: 9 must be a square whose side divides the 4x4 patch grid"):
        resolve_inline_config({**fields, "mm_tokens_per_image": 9}, processor.tokenizer)


def test_processor_is_refused_for_architectures_without_an_offline_recipe(tmp_path):
    from zeropipe.families.vlm.model import build_processor

    with pytest.raises(ConfigError, match="model.processor.*qwen2_vl"):
        build_processor(TINY_QWEN2_VL, ["x"], 300, tmp_path)


def test_pretrained_vlm_loads_tensor_by_tensor_like_from_pretrained(tmp_path):
    from transformers import AutoModelForImageTextToText

    from zeropipe.models.loading import load_pretrained

    torch.manual_seed(0)
    saved = AutoModelForImageTextToText.from_config(vlm_config(section(TINY_LLAVA)))
    saved.save_pretrained(tmp_path)
    streamed = load_pretrained(AutoModelForImageTextToText, tmp_path, dtype=torch.float32, zero_stage=0, device="cpu")
    reference = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32)
    for (name, a), (_, b) in zip(sorted(streamed.state_dict().items()), sorted(reference.state_dict().items())):
        assert torch.equal(a, b), name


def test_planner_counts_the_frozen_tower_and_the_trainable_parts():
    from zeropipe.families import model_spec as spec_from_config

    text = {k: v for k, v in TINY_LLAVA["text_config"].items() if k != "vocab_size"}
    run = RunConfig.model_validate({"model": {"config": {**TINY_LLAVA, "text_config": text}, "trainable": ["projector"]}})
    spec = spec_from_config(run)
    model = meta_model({**TINY_LLAVA, "text_config": {**text, "vocab_size": 301}})  # 300 BPE tokens + <image>
    counts = part_counts(model)
    assert spec.total_params == sum(c["total"] for c in counts.values())
    assert spec.trainable_params == counts["projector"]["total"]

    lora_run = RunConfig.model_validate({"model": {"config": {**TINY_LLAVA, "text_config": text}, "trainable": ["language_model"], "lora": {"r": 4}}})
    lora_spec = spec_from_config(lora_run)
    assert lora_spec.trainable_params == 2 * 4 * ((32 + 32) * 2 + (32 + 16) * 2)  # q,k,v,o adapters in 2 layers
    assert lora_spec.lora is not None and set(lora_spec.lora.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj"}


@pytest.mark.parametrize("fields", [TINY_LLAVA, TINY_GEMMA3], ids=["llava", "gemma3"])
def test_a_mixed_batch_trains_the_chosen_parts_only(tmp_path, fields):
    """Caption and two-image chat examples in one micro-batch: a loss, and gradients only where training happens."""
    from PIL import Image

    from zeropipe.families.vlm.data import VlmEncoder, caption_messages, collate_vlm
    from zeropipe.families.vlm.model import build_processor

    fields = {k: v for k, v in fields.items() if k != "image_token_id"}
    fields["text_config"] = {k: v for k, v in fields["text_config"].items() if k != "vocab_size"}
    processor = build_processor(fields, ["a red circle", "red and green", "Describe the image."] * 20, 300, tmp_path)
    model_section = section(resolve_inline_config(fields, processor.tokenizer).fields, trainable=["projector", "language_model"])
    torch.manual_seed(0)
    model = build_vlm(model_section, vlm_config(model_section), "fp32").train()
    encoder = VlmEncoder(processor)
    red, green = Image.new("RGB", (40, 32), (200, 0, 0)), Image.new("RGB", (32, 48), (0, 200, 0))
    chat = [{"role": "user", "content": "<image> and <image>: colours?"}, {"role": "assistant", "content": "red and green"}]
    batch = collate_vlm(
        [encoder.encode(caption_messages("Describe the image.", "a red circle"), [red]), encoder.encode(chat, [red, green])],
        pad_token_id=processor.tokenizer.pad_token_id,
    )
    assert batch["pixel_values"].shape[0] == 3
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss)
    learning = {part_of(name) for name, p in model.named_parameters() if p.grad is not None and bool(p.grad.abs().sum() > 0)}
    assert learning == {"projector", "language_model"}
    assert all(p.grad is None for name, p in model.named_parameters() if part_of(name) == "vision_tower")
