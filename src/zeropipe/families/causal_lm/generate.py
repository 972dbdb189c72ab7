"""A causal language model's generation: loaded from a run's checkpoint, an export or an adapter, and its answers.

Prompts are rendered with the template the model was trained with
(:func:`zeropipe.data.tokenize.render_prompt`), so the model sees what it learned from.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import torch

from zeropipe.checkpoint.consolidate import consolidated_state_dict, load_checked
from zeropipe.data.tokenize import render_prompt
from zeropipe.errors import ZeroPipeError
from zeropipe.export.generate import DEFAULT_MAX_NEW_TOKENS, Conversation, Generation, LoadedModel, ModelSource, as_messages, check_context, last_user_text, read_run_config
from zeropipe.families.causal_lm.model import add_lora, trained_weights
from zeropipe.models.common import model_config


def load_causal_lm(source: ModelSource, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """A causal language model from a run's checkpoint, an export or an adapter, ready to generate."""
    if source.kind == "run":
        model, tokenizer, default_tokens = causal_lm_from_run(source)
    elif source.kind == "adapter":
        model, tokenizer = causal_lm_from_adapter(source)
        default_tokens = DEFAULT_MAX_NEW_TOKENS
    else:
        model, tokenizer = causal_lm_from_hf_dir(source.path, source.path)
        default_tokens = DEFAULT_MAX_NEW_TOKENS
    model = model.to(device=device, dtype=dtype).eval()
    # The training config turns the KV cache off; generation wants it.
    model.config.use_cache = True
    return LoadedModel(model, tokenizer, source, device, default_tokens)


def causal_lm_from_run(source: ModelSource):
    """The run's model built from its config.yaml, with the checkpoint's consolidated weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert source.checkpoint is not None
    config = read_run_config(source.path)
    section = config.model
    tokenizer_dir = source.path / "tokenizer"
    if not tokenizer_dir.is_dir():
        raise ZeroPipeError(f"{source.path} has no tokenizer/ directory: the run did not finish preparing; generate from another run")
    if section.path and not (Path(section.path).expanduser() / "config.json").is_file():
        raise ZeroPipeError(f"the run was trained from {section.path}, which is no longer a model directory: restore it, or generate from an export")
    if section.path:
        model = AutoModelForCausalLM.from_pretrained(section.path, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(model_config(section), dtype=torch.float32)
    if section.lora is not None:
        model = add_lora(model, section)
    # zero_to_fp32 reports its progress on stdout, which is where --json writes the result.
    with contextlib.redirect_stdout(sys.stderr):
        state = consolidated_state_dict(source.checkpoint)
    # A QLoRA run answers with its adapters on model.path's full-precision base, as its export does.
    load_checked(model, trained_weights(model, section, state), source.checkpoint)
    return model, with_pad_token(AutoTokenizer.from_pretrained(str(tokenizer_dir))), config.generate.max_new_tokens


def causal_lm_from_hf_dir(model_dir: Path, tokenizer_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32), load_tokenizer(tokenizer_dir, model_dir)


def causal_lm_from_adapter(source: ModelSource):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert source.base is not None
    base = AutoModelForCausalLM.from_pretrained(str(source.base), dtype=torch.float32)
    # zeropipe export writes the run's tokenizer beside the adapter; other adapters use the base's.
    return PeftModel.from_pretrained(base, str(source.path)), load_tokenizer(source.path, source.base)


def load_tokenizer(*directories: Path):
    from transformers import AutoTokenizer

    for directory in directories:
        if any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            return with_pad_token(AutoTokenizer.from_pretrained(str(directory)))
    raise ZeroPipeError(f"no tokenizer in {' or '.join(map(str, directories))}: save the tokenizer there (tokenizer.save_pretrained)")


def with_pad_token(tokenizer):
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def generate_text(
    loaded: LoadedModel,
    prompts: list[str | Conversation],
    images: list[str | None],
    tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    raw: bool,
    streamer: Any = None,
) -> list[Generation]:
    """A causal language model's answers; greedy unless ``temperature`` > 0.

    Args:
        prompts: each a user turn's text, or a whole conversation (system, user and assistant
            messages ending with a user turn) rendered with the training template.
        raw: continue the prompt text as it is instead of rendering it as a user turn
            (for models trained on plain text).
        streamer: a transformers streamer (``TextIteratorStreamer``) given each answer's tokens
            as they are made (the web UI streams them to the page).

    Raises:
        ZeroPipeError: images given to a text-only model, a conversation with raw, or a prompt
            and answer longer than the model's positions.
    """
    if raw and any(not isinstance(prompt, str) for prompt in prompts):
        raise ZeroPipeError("raw continues one text; a conversation is rendered with the chat template: send raw false")
    if any(image is not None for image in images):
        raise ZeroPipeError(f"--image needs a vision-language model; {loaded.source.describe()} is a text-only language model: drop --image")

    tokenizer, model = loaded.tokenizer, loaded.model
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {"do_sample": False}
    results = []
    with torch.no_grad():
        for prompt in prompts:
            # The same seed for every prompt: a prompt's sample does not depend on its position.
            torch.manual_seed(seed)
            ids = tokenizer(prompt)["input_ids"] if raw else render_prompt(tokenizer, as_messages(prompt))
            check_context(model, len(ids), tokens)
            input_ids = torch.tensor([ids], device=loaded.device)
            output = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                streamer=streamer,
                **sampling,
            )
            text = tokenizer.decode(output[0, len(ids) :], skip_special_tokens=True)
            results.append(Generation(last_user_text(prompt), text.strip(), prompt_tokens=len(ids)))
    return results
