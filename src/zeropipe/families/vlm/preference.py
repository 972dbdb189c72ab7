"""Preference tuning of a vision-language model (``preference:`` in the run config): pairs with images, the launcher's part and the rank task.

Records (``data.path``, any format ``data.records`` streams, ``data.columns`` renaming columns):

- TRL's vision layout: ``images`` (paths, or the Hub's ``{bytes, path}``) with a conversational
  ``prompt`` / ``chosen`` / ``rejected`` whose contents may be lists of parts
  (``{"type": "image"}``, ``{"type": "text", "text": ...}``); without ``prompt``, the shared first
  turns of ``chosen`` and ``rejected`` are the prompt (TRL's ``extract_prompt``);
- LLaMA-Factory's ``ranking: true`` sharegpt datasets with images (its ``rlhf_v``):
  ``conversations`` in ``from``/``value`` turns with ``<image>`` markers, ``chosen`` / ``rejected``
  one turn each, ``images``.

Every layout the text path reads (``data.preference.normalize_record``) is read here once its
content parts are flattened into ``<image>`` markers; a plain-string prompt becomes a user turn.
Without markers, the images go before the first user message (as in supervised VLM data).

Tokenization is TRL's, through the VLM's own encoder (``data.VlmEncoder``, the supervised
run's rendering with each image expanded by the processor): the prompt (with the generation
prompt) and prompt + answer are encoded with the same processed images, and the answer starts
where the two part, so only answer tokens count (prompt masking as in SFT). Image tokens count
towards ``data.max_seq_len``: a pair too long loses the start of its prompt first, never into
its first image (the model needs all of an image's tokens or none), down to half the length,
then the end of its answers; the launcher encodes every pair once to count both, and refuses a
pair whose prompt and images alone leave no room for an answer.

The rank task is the VLM's (model, LoRA, ZeRO-3, answers about images) with the preference
objective every family shares (``engine.preference.PreferenceObjective``): DPO and its loss
variants, CPO and SimPO; the reference is the base with the LoRA adapters disabled, or log-probs
precomputed once by the ranks for full weights, exactly as for causal LMs.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from zeropipe.checkpoint.manager import write_atomic
from zeropipe.config.schema import RunConfig
from zeropipe.confine import require_usable
from zeropipe.data.formats import RecordError
from zeropipe.data.preference import common_prefix, normalize_record
from zeropipe.data.records import BadRecord, iter_records
from zeropipe.data.sampler import ResumableDistributedSampler
from zeropipe.data.tokenize import pad_token_id, render_prompt
from zeropipe.engine.preference import PreferenceObjective, PreferenceSettings, preference_section_problems, reference_mode
from zeropipe.errors import ConfigError, DataError
from zeropipe.families.vlm.data import (
    GENERATE_FILE,
    IMAGE_MARKER,
    VlmData,
    VlmEncoder,
    _image_files,
    _ImageResolver,
    _place_images,
    check_bad_fraction,
    check_images,
    describe_bad,
    load_rgb,
)
from zeropipe.families.vlm.prepare import complete_model_config, generation_pairs, prepare_processor
from zeropipe.families.vlm.task import VisionLanguageTask
from zeropipe.models.common import hidden_size_of
from zeropipe.rundir import PreparedData, RunDir

log = logging.getLogger("zeropipe")

PAIR_MANIFEST = "vlm_pairs.jsonl"
PAIR_INFO = "vlm_pairs.json"
# The paired methods whose loss needs only the answers' log-probs; the others are refused by config_problems.
VLM_METHODS = ("dpo", "cpo", "simpo")
NOT_MODEL_INPUTS = ("index", "completion_mask", "label")


def vlm_preference_problems(config: RunConfig) -> list[tuple[str, str]]:
    """(key, message with the fix) for a VLM preference run that cannot work; checked before any process starts."""
    section = config.preference
    if section is None:
        return []
    problems = preference_section_problems(config)
    if section.method not in VLM_METHODS:
        why = {
            "kto": "KTO's unpaired examples and KL rows (each prompt and its images with another example's answer)",
            "reward": "a reward model (a score head on the language model)",
            "orpo": "ORPO (its NLL term covers the prompt, which here holds image tokens)",
        }[section.method]
        problems.append(("preference.method", f"{why} is implemented for causal language models, not yet for vision-language models: use method {', '.join(VLM_METHODS)}"))
    return problems


# ----------------------------------------------------------------------------- records
@dataclass
class VlmPair:
    """One preference pair: its images and the prompt and answers as conversations with ``<image>`` markers."""

    images: list[str]  # absolute paths
    prompt: list[dict[str, str]]
    chosen: list[dict[str, str]]
    rejected: list[dict[str, str]]
    where: str = ""


def _flatten(value: Any, found: list[str]) -> Any:
    """Turns whose contents are lists of parts as strings with ``<image>`` markers; image paths in the parts appended to ``found``."""
    if isinstance(value, list):
        return [_flatten(turn, found) for turn in value]
    if isinstance(value, dict) and isinstance(value.get("content"), list):
        pieces = []
        for part in value["content"]:
            if isinstance(part, dict) and part.get("type") == "image":
                pieces.append(IMAGE_MARKER)
                source = part.get("image") or part.get("path")
                if isinstance(source, str):
                    found.append(source)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                pieces.append(part["text"])
            else:
                raise RecordError("a content part is neither {type: text} nor {type: image}")
        return {**value, "content": "\n".join(pieces)}
    return value


def _turns(value: Any, role: str) -> list[dict[str, str]]:
    return [{"role": role, "content": value}] if isinstance(value, str) else value


def pair_of_record(value: dict[str, Any], resolve, image_dir: Path | None) -> VlmPair:
    """A record in one of the layouts above as a :class:`VlmPair`.

    Raises:
        RecordError: no layout fits, no image, or markers and images that do not match.
    """
    if not isinstance(value, dict):
        raise RecordError("a preference pair must be a record (JSON object or table row), not plain text")
    value = dict(value)
    images: list[str] = []
    for key in ("images", "image"):
        if value.get(key) is not None:
            paths, _ = _image_files(value.pop(key), key, image_dir)
            images = [paths] if isinstance(paths, str) else list(paths)
            break
    part_images: list[str] = []
    for key in ("prompt", "chosen", "rejected", "conversations", "messages"):
        if key in value:
            value[key] = _flatten(value[key], part_images)
    normalized = normalize_record(value)
    if "completion" in normalized:
        raise RecordError("an unpaired record (prompt/completion/label): vision-language preference tuning trains on pairs")
    prompt = _turns(normalized["prompt"], "user")
    chosen, rejected = _turns(normalized["chosen"], "assistant"), _turns(normalized["rejected"], "assistant")
    if any(IMAGE_MARKER in turn["content"] for turn in chosen + rejected):
        raise RecordError(f"{IMAGE_MARKER} in an answer: images go in the prompt's user turns")
    images = images or part_images
    prompt = [dict(turn) for turn in prompt]
    _place_images(prompt, len(images))
    return VlmPair([resolve(path) for path in images], prompt, chosen, rejected)


def read_vlm_pairs(path: Path, image_root, columns, image_dir: Path | None) -> VlmData:
    """Every pair of the records at ``path`` (as ``VlmData.examples``: they have ``images`` too), the malformed ones counted, images not yet checked."""
    resolve = _ImageResolver(path if path.is_file() else path / "x", image_root)
    data = VlmData(examples=[], layout="preference pairs with images")
    for item in iter_records(path, columns):
        data.records += 1
        if isinstance(item, BadRecord):
            data.bad_records.append(item)
            continue
        try:
            pair = pair_of_record(item.value, resolve, image_dir)
        except RecordError as error:
            data.bad_records.append(item.bad(str(error)))
            continue
        pair.where = f"{item.file or path.name} {item.unit} {item.line_number}"
        data.examples.append(pair)
    return data


def write_pairs(path: Path, pairs: list[VlmPair]) -> None:
    write_atomic(path, "".join(json.dumps(asdict(pair)) + "\n" for pair in pairs))


def read_pairs(path: Path) -> list[VlmPair]:
    if not path.is_file():
        raise DataError(f"{path} is missing: it is written by the launcher before the ranks start; start the run again to rebuild it")
    return [VlmPair(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------- encoding
@dataclass
class EncodedPair:
    item: dict[str, Any]  # what collate_vlm_pairs takes
    prompt_truncated: bool = False
    completion_truncated: bool = False
    extra_keys: list[str] = field(default_factory=list)


def encode_pair(encoder: VlmEncoder, pair: VlmPair, images: list, max_seq_len: int) -> EncodedPair:
    """A pair's model inputs: prompt ids, each answer's ids, their per-token ids, the images' tensors; cut to ``max_seq_len`` as the module says.

    Raises:
        RecordError: the prompt and its images leave no room for an answer, or an answer is empty once encoded.
    """
    pieces = [encoder.encode_image(image) for image in images]
    prompt = encoder.encode(pair.prompt, images, for_generation=True, pieces=pieces)
    fulls = [encoder.encode(pair.prompt + answer, images, pieces=pieces) for answer in (pair.chosen, pair.rejected)]
    extra_keys = [key for key in prompt if key not in ("input_ids", "labels", "images")]
    prompt_ids = prompt["input_ids"].tolist()
    full_ids = [full["input_ids"].tolist() for full in fulls]
    # The answer starts where prompt and prompt + answer part (TRL's common prefix).
    prompt_len = min(common_prefix(prompt_ids, ids) for ids in full_ids)
    prompt_part = {"ids": prompt_ids[:prompt_len], **{key: prompt[key][:prompt_len].tolist() for key in extra_keys}}
    answers = [{"ids": ids[prompt_len:], **{key: full[key][prompt_len:].tolist() for key in extra_keys}} for ids, full in zip(full_ids, fulls)]
    if not all(answer["ids"] for answer in answers):
        raise RecordError("an answer is empty once encoded")
    result = EncodedPair({}, extra_keys=extra_keys)
    overflow = prompt_len + max(len(answer["ids"]) for answer in answers) - max_seq_len
    if overflow > 0:
        # Tokens before the first image (in the rendering before images are expanded, the same ids) may go; the images stay whole.
        marked = [{"role": m["role"], "content": m["content"].replace(IMAGE_MARKER, encoder.placeholder)} for m in pair.prompt]
        rendered = render_prompt(encoder.tokenizer, marked)
        first_image = rendered.index(encoder.placeholder_id) if encoder.placeholder_id in rendered else prompt_len
        cut = max(0, min(overflow, first_image, prompt_len - max_seq_len // 2))
        if cut:
            prompt_part = {key: values[cut:] for key, values in prompt_part.items()}
            result.prompt_truncated = True
        room = max_seq_len - len(prompt_part["ids"])
        if room <= 0:
            raise RecordError(f"the prompt with its images takes {len(prompt_part['ids'])} tokens, data.max_seq_len {max_seq_len} leaves no room for an answer: raise data.max_seq_len")
        if any(len(answer["ids"]) > room for answer in answers):
            answers = [{key: values[:room] for key, values in answer.items()} for answer in answers]
            result.completion_truncated = True
    result.item = {
        "prompt": prompt_part["ids"],
        "chosen": answers[0]["ids"],
        "rejected": answers[1]["ids"],
        "extra": {key: (prompt_part[key], answers[0][key], answers[1][key]) for key in extra_keys},
        "images": prompt["images"],
    }
    return result


def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(row) for row in rows)
    return torch.tensor([row + [value] * (width - len(row)) for row in rows], dtype=torch.long)


def collate_vlm_pairs(items: list[dict[str, Any]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Chosen rows then rejected rows, right-padded (``data.preference.collate_pairs``' layout), their per-token ids, and each row's images."""
    rows = [(item["prompt"] + item[side], item, side) for side in ("chosen", "rejected") for item in items]
    batch = {
        "input_ids": _pad([ids for ids, _, _ in rows], pad_token_id),
        "attention_mask": _pad([[1] * len(ids) for ids, _, _ in rows], 0),
        "completion_mask": _pad([[0] * len(item["prompt"]) + [1] * len(item[side]) for _, item, side in rows], 0),
        "index": torch.tensor([item["index"] for item in items], dtype=torch.long),
    }
    for key in items[0]["extra"]:
        batch[key] = _pad([item["extra"][key][0] + item["extra"][key][1 if side == "chosen" else 2] for _, item, side in rows], 0)
    for key in items[0]["images"]:
        # Each row's images, in row order: the chosen rows' then the rejected rows' (the same images again).
        batch[key] = torch.cat([item["images"][key] for _, item, _ in rows])
    return batch


class VlmPairDataset(torch.utils.data.Dataset):
    """The launcher's pairs, each image loaded and processed when the pair is used (as the supervised VLM dataset)."""

    def __init__(self, manifest: Path, encoder: VlmEncoder, max_seq_len: int):
        self.pairs = read_pairs(manifest)
        self.encoder, self.max_seq_len = encoder, max_seq_len

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> dict[str, Any]:
        pair = self.pairs[index]
        item = encode_pair(self.encoder, pair, [load_rgb(path) for path in pair.images], self.max_seq_len).item
        item["index"] = index
        return item


# ----------------------------------------------------------------------------- the launcher
def prepare_vlm_preference_data(config: RunConfig, run: RunDir, reuse: bool) -> PreparedData:
    """The pairs read, their images checked, the processor built or copied, every pair encoded once to count truncation.

    Writes RUN/processor, RUN/data/vlm_pairs.jsonl (the good pairs), vlm_pairs.json (their counts)
    and vlm_generate.json (the end-of-run image prompts).

    Raises:
        ConfigError, DataError: with the key and the fix.
    """
    data_section = config.data
    run.data.mkdir(exist_ok=True)
    manifest, info_path = run.data / PAIR_MANIFEST, run.data / PAIR_INFO
    if not data_section.path:
        raise ConfigError([("data.path", "no preference pairs: set data.path to a file of pairs with images (docs/preference.md)")])
    source = Path(data_section.path).expanduser()
    if not source.exists():
        raise DataError(f"data.path {source}: no such file or directory. Fix data.path to point at your preference pairs.")
    require_usable(source, "data.path")
    notes: list[str] = []
    if reuse and manifest.is_file() and info_path.is_file():
        pairs, info = read_pairs(manifest), json.loads(info_path.read_text())
    else:
        found = check_images(read_vlm_pairs(source, data_section.vision.image_root, data_section.columns, run.data / "images"))
        check_bad_fraction(found, source, data_section.max_bad_fraction, data_section.max_bad_records)
        pairs, info = found.examples, {"bad": describe_bad(found) if found.bad_count else ""}
    if not pairs:
        raise DataError(f"data.path {source}: no usable preference pair with images ({info.get('bad') or 'the file is empty'}). Check the file and data.vision.image_root.")
    texts = [turn["content"].replace(IMAGE_MARKER, " ") for pair in pairs for turn in pair.prompt + pair.chosen + pair.rejected]
    processor, processor_notes = prepare_processor(config, run, reuse, texts)
    hf_config, model_notes = complete_model_config(config, processor, pairs[0].images[0])
    if "examples" not in info:
        # Every pair once, as the ranks will encode it: image tokens count towards max_seq_len.
        encoder, kept, too_long = VlmEncoder(processor), [], []
        info.update(prompts_truncated=0, completions_truncated=0)
        for pair in pairs:
            try:
                encoded = encode_pair(encoder, pair, [load_rgb(path) for path in pair.images], data_section.max_seq_len)
            except RecordError as error:
                too_long.append(f"{pair.where}: {error}")
                continue
            kept.append(pair)
            info["prompts_truncated"] += encoded.prompt_truncated
            info["completions_truncated"] += encoded.completion_truncated
        if too_long and len(too_long) > data_section.max_bad_fraction * len(pairs):
            raise DataError(f"{len(too_long)} of {len(pairs)} pairs cannot be used ({'; '.join(too_long[:3])})")
        pairs, info["examples"], info["left_out"] = kept, len(kept), too_long[:3] and [len(too_long), *too_long[:3]]
        write_pairs(manifest, pairs)
        write_atomic(info_path, json.dumps(info))
    notes.append(
        f"preference ({config.preference.method}): {info['examples']} pairs with images from {source}; reference: {reference_mode(config) or 'none (reference-free)'}; "
        "images are loaded and processed in the ranks, not cached"
    )
    if info.get("bad"):
        notes.append(f"skipped: {info['bad']}")
    if info.get("left_out"):
        notes.append(f"left out {info['left_out'][0]} pair(s) with no room for an answer ({'; '.join(info['left_out'][1:])})")
    if info["prompts_truncated"] or info["completions_truncated"]:
        notes.append(
            f"max_seq_len {data_section.max_seq_len} (image tokens included): {info['prompts_truncated']} prompt(s) lost their start and "
            f"{info['completions_truncated']} pair(s) their answers' end (prompts are cut first, never into an image); raise data.max_seq_len to keep them whole"
        )
    notes += processor_notes + model_notes
    generation = generation_pairs(config, run)
    write_atomic(run.data / GENERATE_FILE, json.dumps(generation, indent=2))
    count = int(info["examples"])
    return PreparedData(
        examples=count,
        hidden_size=hidden_size_of(hf_config),
        micro_batches_per_epoch=lambda micro, world_size: (count // world_size) // micro,
        prompts=[pair["prompt"] for pair in generation],
        notes=notes,
    )


# ----------------------------------------------------------------------------- the rank
class VlmPreferenceTask(PreferenceObjective, VisionLanguageTask):
    """A vision-language model trained on preference pairs with images: the VLM's task with the shared preference objective."""

    def setup_data(self) -> None:
        from transformers import AutoProcessor

        trainer = self.trainer
        self.settings = PreferenceSettings.of(trainer.config.preference)
        self.reference_mode = reference_mode(trainer.config)
        self.processor = AutoProcessor.from_pretrained(str(trainer.run.processor))
        self.tokenizer = self.processor.tokenizer
        self.encoder = VlmEncoder(self.processor)  # used for the end-of-run answers too
        self.dataset = VlmPairDataset(trainer.run.data / PAIR_MANIFEST, self.encoder, trainer.config.data.max_seq_len)
        self.sampler = ResumableDistributedSampler(len(self.dataset), trainer.rank, trainer.world_size, seed=trainer.config.run.seed, shuffle=True)
        self.collate = partial(collate_vlm_pairs, pad_token_id=pad_token_id(self.tokenizer))
        self.reference = None
        self.step_figures = []

    def batch_to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.to_device(batch)  # pixel values in the model's dtype

    @staticmethod
    def logits(model, batch: dict[str, torch.Tensor], prefix: str = "") -> torch.Tensor:
        inputs = {key: value for key, value in batch.items() if key not in NOT_MODEL_INPUTS}
        return model(**inputs, use_cache=False).logits

    def forward_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float, float]:
        # Counted on the host batch, before it moves: no wait for the device.
        tokens, examples = float(batch["attention_mask"].sum()), float(batch["index"].shape[0])
        return self.preference_loss(self.batch_to_device(batch)), tokens, examples
