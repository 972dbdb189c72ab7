"""``zeropipe generate`` for vision-language models: a run's checkpoint, an export or an adapter, prompted with images."""

from __future__ import annotations

import torch

from zeropipe.checkpoint.consolidate import consolidated_state_dict, load_checked
from zeropipe.data.tokenize import pad_token_id
from zeropipe.errors import ZeroPipeError
from zeropipe.export.generate import Generation, LoadedModel, as_messages, check_context, last_user_text, read_run_config
from zeropipe.families.vlm.data import IMAGE_MARKER, VlmEncoder, image_problem, load_rgb
from zeropipe.families.vlm.model import build_vlm_for_export
from zeropipe.models.common import trained_weights
from zeropipe.rundir import RunDir


def load_for_generation(source, device: torch.device, dtype: torch.dtype):
    """The model and processor of ``source`` (see :func:`zeropipe.export.generate.resolve_source`), ready to generate.

    Raises:
        ZeroPipeError: a run without its processor, a QLoRA run, or a directory without one.
    """
    import contextlib
    import sys

    from transformers import AutoModelForImageTextToText, AutoProcessor

    default_tokens = None
    if source.kind == "run":
        config = read_run_config(source.path)
        if config.model.quantization is not None and not config.model.quantization.is_fp8:
            raise ZeroPipeError(f"{source.path} is a QLoRA run: export the adapter (zeropipe export) and generate from it on a CUDA machine")
        processor_dir = RunDir(source.path).processor
        if not processor_dir.is_dir():
            raise ZeroPipeError(f"{source.path} has no processor/ directory: the run did not finish preparing; generate from another run")
        model = build_vlm_for_export(config.model)
        # zero_to_fp32 reports its progress on stdout, which is where --json writes the result.
        with contextlib.redirect_stdout(sys.stderr):
            state = consolidated_state_dict(source.checkpoint)
        # An fp8 base's checkpoint holds it as bytes: the adapters come from it, the base from model.path (as the export does).
        load_checked(model, trained_weights(model, config.model, state), source.checkpoint)
        default_tokens = config.generate.max_new_tokens
    elif source.kind == "adapter":
        from peft import PeftModel

        base = AutoModelForImageTextToText.from_pretrained(str(source.base), dtype=torch.float32)
        model = PeftModel.from_pretrained(base, str(source.path))
        processor_dir = source.path if (source.path / "processor_config.json").is_file() or (source.path / "preprocessor_config.json").is_file() else source.base
    else:
        model = AutoModelForImageTextToText.from_pretrained(str(source.path), dtype=torch.float32)
        processor_dir = source.path
    try:
        processor = AutoProcessor.from_pretrained(str(processor_dir))
    except (OSError, ValueError) as error:
        raise ZeroPipeError(f"no usable processor in {processor_dir} ({error}): save the model's AutoProcessor there (processor.save_pretrained)") from error
    model = model.to(device=device, dtype=dtype).eval()
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.use_cache = True
    loaded = LoadedModel(model, processor, source, device)
    if default_tokens:
        loaded.default_max_new_tokens = default_tokens
    return loaded


def generate_with_images(loaded, prompts: list[str], images: list[str | None], max_new_tokens: int, temperature: float, top_p: float, seed: int, streamer=None):
    """Answer each prompt about its image (or as text alone), rendered as in training.

    ``streamer`` is handed to ``model.generate`` (the UI's cancellation check, asked at each token).

    Raises:
        ZeroPipeError: an image that cannot be read.
    """

    for image in images:
        if image is not None and (problem := image_problem(image)) is not None:
            raise ZeroPipeError(f"--image {image}: {problem}")
    encoder = VlmEncoder(loaded.tokenizer)
    tokenizer = encoder.tokenizer
    pad_id = pad_token_id(tokenizer)
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {"do_sample": False}
    dtype = next(loaded.model.parameters()).dtype
    results = []
    with torch.no_grad():
        for prompt, image in zip(prompts, images):
            torch.manual_seed(seed)
            messages = as_messages(prompt)
            if image is not None:  # the picture goes with the first user turn, as in the training records
                first = next(index for index, message in enumerate(messages) if message["role"] == "user")
                messages[first] = {"role": "user", "content": f"{IMAGE_MARKER}\n{messages[first]['content']}"}
            example = encoder.encode(messages, [load_rgb(image)] if image is not None else [], for_generation=True)
            inputs = {key: value[None].to(loaded.device) for key, value in example.items() if key not in ("images", "labels")}
            check_context(loaded.model, inputs["input_ids"].shape[1], max_new_tokens)
            inputs.update({key: value.to(loaded.device, dtype=dtype if value.is_floating_point() else value.dtype) for key, value in example["images"].items()})
            output = loaded.model.generate(
                **inputs, attention_mask=torch.ones_like(inputs["input_ids"]), max_new_tokens=max_new_tokens,
                pad_token_id=pad_id, eos_token_id=tokenizer.eos_token_id, streamer=streamer, **sampling,
            )
            answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
            results.append(Generation(last_user_text(prompt), answer, image, prompt_tokens=int(inputs["input_ids"].shape[1])))
    return results
