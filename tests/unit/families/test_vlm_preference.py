"""Preference tuning of a vision-language model: pairs with images, read, encoded and trained with DPO under ZeRO-3.

The training test runs one rank of the real trainer in this process (DeepSpeed ZeRO-3 on the CPU,
gloo, world size 1) on a tiny Gemma 3 (the preset of tests/integration/test_vlm.py) with LoRA on
its language model, on a task only the image can decide: "What colour is this?" about a solid
red, green or blue square, the right colour preferred to each wrong one. Every ordered
(right, wrong) pair is there with its mirror, so a model blind to the image gets exactly half
of them right; DPO's accuracy ends at 1 and its margin grows, and the exported adapter, loaded
on the base with peft, prefers the right colour (against the base) on every pair.
"""

from __future__ import annotations

import gc
import itertools
import json
import socket
from pathlib import Path

import pytest
import torch

TINY_GEMMA3 = {
    "model_type": "gemma3",
    "mm_tokens_per_image": 4,
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "image_size": 32, "patch_size": 8, "vision_use_head": False},
    "text_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "head_dim": 16, "max_position_embeddings": 128, "sliding_window": 32},
}
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}
QUESTION = "What colour is this?"
STEPS = 6


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def colour_pairs(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Every (right, wrong) colour pair in TRL's vision layout, and a tiny Gemma 3 base with its processor on disk."""
    from PIL import Image
    from transformers import CONFIG_MAPPING, AutoModelForImageTextToText

    from zeropipe.families.vlm.model import build_processor, resolve_inline_config

    tmp_path = tmp_path_factory.mktemp("vlm-preference")
    for name, rgb in COLOURS.items():
        Image.new("RGB", (32, 32), rgb).save(tmp_path / f"{name}.png")
    rows = [
        {"images": [f"{right}.png"],
         "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
         "chosen": [{"role": "assistant", "content": [{"type": "text", "text": right}]}],
         "rejected": [{"role": "assistant", "content": [{"type": "text", "text": wrong}]}]}
        for right, wrong in itertools.permutations(COLOURS, 2)
    ]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    base = tmp_path / "gemma3-base"
    processor = build_processor(TINY_GEMMA3, [QUESTION, *COLOURS], 300, base)
    fields = dict(resolve_inline_config(TINY_GEMMA3, processor.tokenizer).fields)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(CONFIG_MAPPING[fields.pop("model_type")](**fields))
    # transformers starts Gemma 3's projector at zero (a blind model); a pretrained one sees: random weights here.
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=1.0)
    model.save_pretrained(base)
    return tmp_path, rows


def run_config(root: Path, **preference) -> dict:
    return {
        "run": {"name": "vlm-dpo", "output_dir": str(root / "runs"), "seed": 5},
        "model": {"path": str(root / "gemma3-base"), "trainable": ["language_model"], "lora": {"r": 8, "alpha": 16, "dropout": 0.0}},
        "data": {"path": str(root / "pairs.jsonl"), "max_seq_len": 48},
        "train": {"max_steps": STEPS, "micro_batch_size": 6, "lr": 1e-2, "schedule": "constant", "log_every": 1},
        "deepspeed": {"zero_stage": 3, "precision": "fp32"},
        "hardware": {"gpus": 1, "accelerator": "cpu"},
        "preference": {"method": "dpo", "beta": 1.0, **preference},
        "generate": {"prompts": []},
    }


def validated(raw: dict):
    import yaml

    from zeropipe.config.load import validate_config

    return validate_config(yaml.safe_load(yaml.safe_dump(raw)))


def pair_logps(model, processor, pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed answer log-probs of each pair, encoded and collated as the ranks do."""
    from zeropipe.engine.preference import sequence_logps
    from zeropipe.families.vlm.data import VlmEncoder, load_rgb
    from zeropipe.families.vlm.preference import NOT_MODEL_INPUTS, collate_vlm_pairs, encode_pair

    encoder = VlmEncoder(processor)
    items = []
    for index, pair in enumerate(pairs):
        item = encode_pair(encoder, pair, [load_rgb(path) for path in pair.images], 48).item
        items.append({**item, "index": index})
    batch = collate_vlm_pairs(items, processor.tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(**{key: value for key, value in batch.items() if key not in NOT_MODEL_INPUTS}).logits
    return sequence_logps(logits.float(), batch)[0].chunk(2)


def test_trl_and_llama_factory_layouts_read_as_the_same_pair(tmp_path):
    from zeropipe.data.formats import RecordError
    from zeropipe.families.vlm.data import _ImageResolver
    from zeropipe.families.vlm.preference import pair_of_record

    resolve = _ImageResolver(tmp_path / "pairs.jsonl", None)
    trl = pair_of_record({"images": ["a.png"], "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}],
                          "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "red"}]}],
                          "rejected": [{"role": "assistant", "content": "blue"}]}, resolve, None)
    # LLaMA-Factory's rlhf_v (ranking: true, sharegpt, columns messages/chosen/rejected/images)
    factory = pair_of_record({"images": ["a.png"], "conversations": [{"from": "human", "value": "<image>\nColour?"}],
                              "chosen": {"from": "gpt", "value": "red"}, "rejected": {"from": "gpt", "value": "blue"}}, resolve, None)
    assert trl == factory
    assert trl.images == [str((tmp_path / "a.png").resolve())] and trl.prompt == [{"role": "user", "content": "<image>\nColour?"}]
    # Without markers the image goes before the first user turn; a marker count that does not match is refused.
    plain = pair_of_record({"image": "a.png", "prompt": "Colour?", "chosen": "red", "rejected": "blue"}, resolve, None)
    assert plain.prompt == [{"role": "user", "content": "<image>\nColour?"}] and plain.chosen == [{"role": "assistant", "content": "red"}]
    with pytest.raises(RecordError, match="marker"):
        pair_of_record({"images": ["a.png"], "prompt": "<image><image> Colour?", "chosen": "red", "rejected": "blue"}, resolve, None)


def test_check_accepts_vlm_dpo_and_refuses_what_cannot_work(colour_pairs):
    from zeropipe.families import family_of

    root, _ = colour_pairs
    family = family_of(validated(run_config(root)).model)
    assert family.name == "vlm" and family.config_problems(validated(run_config(root))) == []
    problems = dict(family.config_problems(validated(run_config(root, method="kto"))))
    assert "not yet for vision-language models" in problems["preference.method"]
    full = run_config(root, reference="adapters_off")
    full["model"].pop("lora")
    assert "adapters_off needs model.lora" in dict(family.config_problems(validated(full)))["preference.reference"]


def test_long_pairs_are_cut_before_the_image_and_in_the_answers_never_inside_the_image(colour_pairs):
    from transformers import AutoProcessor

    from zeropipe.families.vlm.data import VlmEncoder, load_rgb
    from zeropipe.families.vlm.preference import VlmPair, encode_pair

    root, _ = colour_pairs
    processor = AutoProcessor.from_pretrained(root / "gemma3-base")
    encoder = VlmEncoder(processor)
    image = root / "red.png"
    pair = VlmPair([str(image)], [{"role": "user", "content": f"<image>\n{QUESTION}"}],
                   [{"role": "assistant", "content": " ".join(["red"] * 40)}], [{"role": "assistant", "content": "blue"}])
    whole = encode_pair(encoder, pair, [load_rgb(image)], 512)
    cut = encode_pair(encoder, pair, [load_rgb(image)], 32)
    image_ids = encoder.encode_image(load_rgb(image)).ids
    assert not whole.prompt_truncated and cut.prompt_truncated and cut.completion_truncated
    assert len(cut.item["prompt"]) + len(cut.item["chosen"]) == 32
    # The prompt lost only tokens before its image: the image's tokens (Gemma 3: its start and end markers
    # around 4 soft tokens) are all there, and what follows is the whole prompt's end.
    def starts(ids):
        return [i for i in range(len(ids)) if ids[i : i + len(image_ids)] == image_ids]

    assert starts(cut.item["prompt"]) == [0] and len(starts(whole.item["prompt"])) == 1
    assert cut.item["prompt"] == whole.item["prompt"][starts(whole.item["prompt"])[0] :]
    assert cut.item["extra"]["token_type_ids"][0] == whole.item["extra"]["token_type_ids"][0][-len(cut.item["prompt"]):]


def train_one_rank(run_path: Path) -> None:
    """The rank's own path, in this process; the trainer (and the ZeRO-3 config transformers holds with it) gone on return."""
    from zeropipe.engine.trainer import Trainer
    from zeropipe.families import family_of
    from zeropipe.rundir import RunDir

    trainer = Trainer(run_path, family_of(RunDir(run_path).read_config().model).rank_task)
    trainer.setup()
    assert trainer.engine.zero_optimization_stage() == 3
    trainer.task.before_train()
    trainer.train()
    trainer.task.after_train()
    trainer.cleanup()


@pytest.mark.timeout(300)
def test_vlm_dpo_lora_learns_the_colour_under_zero3_and_exports(colour_pairs, tmp_path, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from transformers.integrations import is_deepspeed_zero3_enabled

    from zeropipe.families import export_run
    from zeropipe.families.vlm.preference import PAIR_MANIFEST, read_pairs
    from zeropipe.launch.prepare import prepare_run
    from zeropipe.launch.resolve import resolve_run

    root, _ = colour_pairs
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    prepared = prepare_run(resolve_run(validated(run_config(root))))
    run = prepared.run
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("ZEROPIPE_LAUNCHER_PID", raising=False)
    train_one_rank(run.path)
    gc.collect()  # the trainer's reference cycles: transformers holds the ZeRO-3 config weakly, until they go
    assert not is_deepspeed_zero3_enabled(), "the export below would be built partitioned"
    rows = [row for row in run.read_metrics() if "rewards_accuracy" in row]
    assert len(rows) == STEPS
    # Step 1: the policy is its reference (adapters off = on), rewards 0, loss ln 2; then DPO pulls the colours apart.
    assert rows[0]["rewards_margin"] == 0 and rows[0]["loss"] == pytest.approx(0.6931, abs=1e-3)
    assert rows[-1]["rewards_accuracy"] == 1.0 and rows[-1]["rewards_margin"] > 1.0, rows[-1]
    assert rows[-1]["logps_chosen"] > rows[-1]["logps_rejected"]

    export = export_run(run.path, tmp_path / "export", dtype="fp32")
    processor = AutoProcessor.from_pretrained(export)
    pairs = read_pairs(run.data / PAIR_MANIFEST)
    base = AutoModelForImageTextToText.from_pretrained(root / "gemma3-base", dtype=torch.float32).eval()
    start_chosen, start_rejected = pair_logps(base, processor, pairs)
    trained = PeftModel.from_pretrained(base, export).eval()
    chosen, rejected = pair_logps(trained, processor, pairs)
    implicit = ((chosen - start_chosen) > (rejected - start_rejected)).float().mean()
    assert float(implicit) == 1.0, (chosen - start_chosen) - (rejected - start_rejected)


@pytest.mark.timeout(300)
def test_vlm_dpo_full_weights_precomputes_its_reference_from_the_starting_weights(colour_pairs, monkeypatch):
    import numpy as np

    from zeropipe.launch.prepare import prepare_run
    from zeropipe.launch.resolve import resolve_run

    root, rows = colour_pairs
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    raw = run_config(root)
    raw["model"].pop("lora")
    raw["run"]["name"] = "vlm-dpo-full"
    raw["train"].update(max_steps=2, lr=1e-3)
    prepared = prepare_run(resolve_run(validated(raw)))
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("ZEROPIPE_LAUNCHER_PID", raising=False)
    train_one_rank(prepared.run.path)
    gc.collect()
    reference = np.load(prepared.run.cache / "reference_logps.npy")
    assert reference.shape == (len(rows), 2) and np.isfinite(reference).all() and (reference < 0).all()
    steps = [row for row in prepared.run.read_metrics() if "rewards_accuracy" in row]
    # Step 1 trains from the weights the reference was computed from: every reward is 0, the loss ln 2.
    assert steps[0]["rewards_margin"] == pytest.approx(0, abs=1e-6) and steps[0]["loss"] == pytest.approx(0.6931, abs=1e-4)
    assert steps[1]["loss"] < steps[0]["loss"]


TINY_LLAVA = {
    "model_type": "llava",
    "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "image_size": 32, "patch_size": 8, "projection_dim": 32},
    "text_config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "max_position_embeddings": 128, "tie_word_embeddings": False},
}
# A chat template that renders image parts (TRL's vision collator renders the records' parts with it; ZeRO-Pipe renders
# the same turns with <image> markers joined by a newline, hence the newline after the image).
IMAGE_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>\n{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_vlm_dpo_matches_trls_trainer_from_the_same_records(colour_pairs, tmp_path):
    """TRL 1.16's DPOTrainer with a processor (its DataCollatorForVisionPreference, forward pass and loss) and ZeRO-Pipe's
    path (pair_of_record, encode_pair, collate_vlm_pairs, the model, dpo_loss): the same rows, loss and figures to 1e-5, fp32."""
    pytest.importorskip("trl")
    import copy

    from datasets import Dataset
    from PIL import Image
    from transformers import CONFIG_MAPPING, AutoModelForImageTextToText
    from trl import DPOConfig, DPOTrainer

    from zeropipe.engine.preference import PreferenceSettings, dpo_loss, sequence_logps
    from zeropipe.families.vlm.data import VlmEncoder, _ImageResolver, load_rgb
    from zeropipe.families.vlm.model import build_processor, resolve_inline_config
    from zeropipe.families.vlm.preference import NOT_MODEL_INPUTS, collate_vlm_pairs, encode_pair, pair_of_record

    root, rows = colour_pairs
    rows = [{**row, "rejected": [{"role": "assistant", "content": [{"type": "text", "text": row["rejected"][0]["content"][0]["text"] + " it is"}]}]}
            for row in rows[:4]]  # answers of different lengths: padding on both sides
    processor = build_processor(TINY_LLAVA, [QUESTION, *COLOURS, "it is"], 300, tmp_path / "processor")
    processor.chat_template = processor.tokenizer.chat_template = IMAGE_TEMPLATE
    processor.tokenizer.pad_token = processor.tokenizer.pad_token or processor.tokenizer.eos_token
    fields = dict(resolve_inline_config(TINY_LLAVA, processor.tokenizer).fields)
    config = CONFIG_MAPPING[fields.pop("model_type")](**fields)
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config).float()
        with torch.no_grad():  # larger weights than the init: log-probs that differ visibly between answers
            for parameter in model.parameters():
                parameter.mul_(4 if parameter.dim() > 1 else 1)
        models.append(model)
    policy, reference = models[0].train(), models[1].eval()

    records = [{**row, "images": [Image.open(root / row["images"][0]).convert("RGB")]} for row in rows]
    trainer = DPOTrainer(
        model=copy.deepcopy(policy), ref_model=copy.deepcopy(reference), processing_class=processor, train_dataset=Dataset.from_list(records),
        args=DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(rows), report_to=[], use_cpu=True, bf16=False, fp16=False,
                       beta=0.2, max_length=None),
    )
    trl_batch = trainer.data_collator([copy.deepcopy(trainer.train_dataset[i]) for i in range(len(rows))])
    trl_loss = trainer.compute_loss(trainer.model, trl_batch)

    encoder, resolve, items = VlmEncoder(processor), _ImageResolver(root / "pairs.jsonl", None), []
    for index, row in enumerate(rows):
        pair = pair_of_record(row, resolve, None)
        items.append({**encode_pair(encoder, pair, [load_rgb(path) for path in pair.images], 512).item, "index": index})
    batch = collate_vlm_pairs(items, processor.tokenizer.pad_token_id)
    for key in ("input_ids", "completion_mask", "pixel_values"):  # both right-padded here (TRL flushes its left padding)
        assert torch.equal(batch[key], trl_batch[key]), key

    def logits(model, inputs):
        return model(**{key: value for key, value in inputs.items() if key not in NOT_MODEL_INPUTS}).logits

    with torch.no_grad():
        ref_chosen, ref_rejected = sequence_logps(logits(reference, batch), batch)[0].chunk(2)
    loss, figures = dpo_loss(PreferenceSettings(method="dpo", beta=0.2), logits(policy, batch), batch, ref_chosen, ref_rejected)
    assert float(loss) == pytest.approx(float(trl_loss), abs=1e-5)
    names = {"rewards_chosen": "rewards/chosen", "rewards_rejected": "rewards/rejected", "rewards_margin": "rewards/margins",
             "rewards_accuracy": "rewards/accuracies", "logps_chosen": "logps/chosen", "logps_rejected": "logps/rejected"}
    for mine, theirs in names.items():
        assert float(figures[mine]) == pytest.approx(trainer._metrics["train"][theirs][-1], abs=1e-5), mine
    assert float(figures["rewards_margin"]) != 0
