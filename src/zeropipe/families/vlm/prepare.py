"""The launcher's part of a vision-language run: the image-text data read and checked, the processor built or copied."""

from __future__ import annotations

import json
from pathlib import Path

from zeropipe.checkpoint.manager import write_atomic
from zeropipe.config.schema import RunConfig
from zeropipe.data.images import generate_shapes_dataset, scan_image_folder
from zeropipe.errors import ConfigError
from zeropipe.families.vlm.data import (
    GENERATE_FILE,
    HELD_OUT_IMAGES,
    IMAGE_MARKER,
    MANIFEST,
    SYNTHETIC_RESOLUTION,
    VlmEncoder,
    describe_bad,
    image_problem,
    load_rgb,
    load_vlm_data,
    read_manifest,
    write_manifest,
)
from zeropipe.families.vlm.model import build_processor, check_trainable, resolve_inline_config, vlm_config
from zeropipe.models.common import hidden_size_of
from zeropipe.rundir import PreparedData, RunDir


def prepare_vlm_data(config: RunConfig, run: RunDir, reuse: bool) -> PreparedData:
    """Read and check the image-text data, build or copy the processor, complete the model config.

    Writes RUN/processor (what ranks and export load), RUN/data/vlm_examples.jsonl (the good
    examples) and RUN/data/vlm_generate.json (the end-of-run image prompts).

    Raises:
        ConfigError, DataError: with the key and the fix.
    """
    data_section = config.data
    notes: list[str] = []
    run.data.mkdir(exist_ok=True)
    manifest = run.data / MANIFEST

    if data_section.synthetic is not None:
        if data_section.synthetic.task != "shapes":
            raise ConfigError([("data.synthetic.task", f"{data_section.synthetic.task!r} is a text task; vision-language models train on 'shapes'")])
        source = run.data / "shapes"
        if not (reuse and manifest.is_file()):
            generate_shapes_dataset(source, data_section.synthetic.examples, data_section.synthetic.seed, SYNTHETIC_RESOLUTION)
    else:
        if not data_section.path:
            raise ConfigError([("data.path", "no training data: set data.path (captions file or image folder) or data.synthetic.task: shapes")])
        source = Path(data_section.path).expanduser()
    if reuse and manifest.is_file():
        examples = read_manifest(manifest)
    else:
        vision = data_section.vision
        found = load_vlm_data(
            source, vision.image_root, vision.caption_prompt, data_section.max_bad_fraction, data_section.max_bad_records, image_dir=run.data / "images"
        )
        examples = found.examples
        notes.append(f"{len(examples)} image-text examples from {source} ({found.layout}); images are loaded and processed in the ranks, not cached")
        if found.bad_count:
            notes.append(f"skipped: {describe_bad(found)}")
        write_manifest(manifest, examples)

    texts = [m["content"].replace(IMAGE_MARKER, " ") for ex in examples for m in ex.messages]
    processor, processor_notes = prepare_processor(config, run, reuse, texts)
    notes += processor_notes
    hf_config, model_notes = complete_model_config(config, processor, examples[0].images[0])
    notes += model_notes

    pairs = generation_pairs(config, run)
    write_atomic(run.data / GENERATE_FILE, json.dumps(pairs, indent=2))
    count = len(examples)
    return PreparedData(
        examples=count,
        hidden_size=hidden_size_of(hf_config),
        micro_batches_per_epoch=lambda micro, world_size: (count // world_size) // micro,
        prompts=[pair["prompt"] for pair in pairs],
        notes=notes,
    )


def prepare_processor(config: RunConfig, run: RunDir, reuse: bool, texts: list[str]):
    """The run's processor (RUN/processor, what the ranks and export read): reused, copied, or built with a tokenizer trained on ``texts``.

    Returns:
        (processor, notes)

    Raises:
        ConfigError: model.processor (or model.path) holds no saved processor.
    """
    from transformers import AutoProcessor

    section, notes = config.model, []
    processor_dir = run.processor
    if reuse and processor_dir.is_dir():
        processor = AutoProcessor.from_pretrained(str(processor_dir))
    elif section.processor or section.path:
        source_dir = Path(section.processor or section.path).expanduser()
        if not any((source_dir / name).is_file() for name in ("processor_config.json", "preprocessor_config.json")):
            message = f"{source_dir} holds no saved processor (processor_config.json or preprocessor_config.json): set model.processor"
            raise ConfigError([("model.processor", message)])
        processor = AutoProcessor.from_pretrained(str(source_dir))
        processor.save_pretrained(str(processor_dir))
    else:
        texts = [*texts, config.data.vision.caption_prompt, *(config.generate.prompts or [])]
        processor = build_processor(section.config or {}, texts, section.tokenizer_vocab_size, processor_dir)
        notes.append(
            f"processor built for {section.config.get('model_type')}: "
            f"image processor + tokenizer of {len(processor.tokenizer)} tokens trained on the data"
        )
    tokenizer = processor.tokenizer
    if tokenizer.pad_token is None:
        # Padding is masked out of attention and loss, so the EOS token can stand in.
        tokenizer.pad_token = tokenizer.eos_token
        processor.save_pretrained(str(processor_dir))
    return processor, notes


def complete_model_config(config: RunConfig, processor, probe_image: str):
    """The model config completed from the processor (an inline config's vocabulary and image tokens), checked against it and the data.

    Returns:
        (the transformers config, notes)

    Raises:
        ConfigError: the processor and the model do not belong together, or an image leaves no room in data.max_seq_len.
    """
    section, notes = config.model, []
    tokenizer = processor.tokenizer
    if section.config is not None:
        resolved = resolve_inline_config(section.config, tokenizer)
        section.config = resolved.fields
        notes += resolved.filled
    hf_config = vlm_config(section)
    text_config = hf_config.get_text_config()
    if getattr(text_config, "vocab_size", None) is not None and len(tokenizer) > text_config.vocab_size:
        message = f"its tokenizer has {len(tokenizer)} tokens, the language model's vocabulary {text_config.vocab_size}: use the model's processor"
        raise ConfigError([("model.processor", message)])
    notes += _probe(processor, hf_config, probe_image, config.data.max_seq_len)
    parts = check_trainable(section, hf_config)
    how = "LoRA" if section.lora is not None else "full"
    trained = [f"{part} ({how}, {c['total']:,} parameters)" for part, c in parts.items() if c["trainable"]]
    frozen = [f"{part} ({c['total']:,})" for part, c in parts.items() if not c["trainable"] and c["total"]]
    notes.append(f"trains: {', '.join(trained)}; frozen: {', '.join(frozen) or 'nothing'}")
    return hf_config, notes


def _probe(processor, hf_config, image: str, max_seq_len: int) -> list[str]:
    """Encode one image: its tokens must be the model's image tokens and fit in data.max_seq_len."""
    encoder = VlmEncoder(processor)
    piece = encoder.encode_image(load_rgb(image))
    image_token_id = getattr(hf_config, "image_token_id", None)
    if image_token_id is None:
        image_token_id = getattr(hf_config, "image_token_index", None)
    if image_token_id is not None and image_token_id not in piece.ids:
        message = (
            f"the processor expands an image to token ids without the model's image_token_id {image_token_id}: "
            "the processor and the model do not belong together"
        )
        raise ConfigError([("model.processor", message)])
    if len(piece.ids) >= max_seq_len:
        message = f"{max_seq_len} leaves no room for text: one image takes {len(piece.ids)} tokens. Raise it above {len(piece.ids) + 32}"
        raise ConfigError([("data.max_seq_len", message)])
    return [f"each image takes {len(piece.ids)} tokens of data.max_seq_len {max_seq_len}"]


def generation_pairs(config, run) -> list[dict[str, str]]:
    """The (prompt, image) pairs answered at the end of the run; held-out synthetic shapes by default.

    Raises:
        ConfigError: prompts and images that cannot be paired, or a missing image.
    """
    if config.generate.prompts == []:
        return []  # nothing to answer at the end of the run
    prompts, images = list(config.generate.prompts or []), list(config.generate.images)
    default_prompt = config.data.vision.caption_prompt
    expected: list[str | None] = []
    if not images:
        seed = (config.data.synthetic.seed if config.data.synthetic else config.run.seed) + 1_000_003
        folder = run.data / "heldout"
        generate_shapes_dataset(folder, HELD_OUT_IMAGES, seed, SYNTHETIC_RESOLUTION)
        items = scan_image_folder(folder).items
        images = [str(item.path) for item in items]
        expected = [item.caption for item in items]
    if not prompts:
        prompts = [default_prompt] * len(images)
    elif len(prompts) == 1:
        prompts = prompts * len(images)
    elif len(prompts) != len(images):
        message = f"{len(images)} image(s) for {len(prompts)} prompts: give one image per prompt, or one prompt for all images"
        raise ConfigError([("generate.images", message)])
    missing = [image for image in images if image_problem(image) is not None]
    if missing:
        raise ConfigError([("generate.images", f"cannot read {', '.join(missing[:3])}: {image_problem(missing[0])}")])
    pairs = []
    for index, (prompt, image) in enumerate(zip(prompts, images)):
        pair = {"prompt": prompt, "image": str(Path(image).expanduser().resolve())}
        if index < len(expected) and expected[index] is not None:
            pair["expected"] = expected[index]
        pairs.append(pair)
    return pairs
