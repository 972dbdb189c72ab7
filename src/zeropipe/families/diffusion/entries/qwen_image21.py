"""Qwen-Image 2.1: a 7B single-stream, block-causal DiT on unpatched latents of a 16x, 64-channel RGBA VAE, conditioned on Qwen3-VL-8B.

What ``QwenImage21Pipeline`` does, and what the entry takes from it:

- **Latents.** ``AutoencoderKLQwenImage21`` is Wan 2.2's VAE layout for one frame: 16x spatial, 64
  latent channels, and **four image channels (RGBA)**. The pipeline hands it RGBA images
  (``convert("RGBA")``: an opaque image has alpha 1 in [-1, 1]) and decodes four channels. The codec
  adds that opaque alpha channel to every training image and drops it from decoded samples.
  Latents are normalised per channel (``latents_mean`` / ``latents_std``), as the pipeline's
  ``_encode_vae_image`` does, and kept as (batch, 64, 1, h, w), one token per latent pixel
  (``_pack_latents`` is a plain flatten).
- **Prompts.** ``encode_prompt`` wraps each prompt in a fixed system/user/assistant template, runs
  Qwen3-VL and keeps the last decoder layer's output (before the final norm) after the system turn's
  tokens, at the prompt's own length with a mask.
- **The denoiser call.** One joint sequence: the prompt's tokens, then one slot per 2x2 group of the
  target's latent tokens (``img_mask``), expanded four-fold by the transformer. Attention is causal
  over the prompt and bidirectional inside the image; the prompt is modulated at t = 0
  (``causal_condition``). The image's frame position is the text's length, padding included, and the
  transformer reads one layout (``img_mask[0]``) for the whole batch: ``predict`` calls it once per
  prompt length, so a caption's prediction does not depend on its batch's padding (it is what the
  pipeline computes for that prompt alone).

The processor. The pipeline takes a ``Qwen3VLProcessor`` and calls it even for text-to-image
(``apply_chat_template`` on its system message to count the tokens to drop, and ``processor(text=...)``).
transformers builds a Qwen3VLProcessor only with torchvision installed: its video processor
(``Qwen3VLVideoProcessor``) needs it, and the processor refuses to be built without one (``video_processor=None``
fails ``ProcessorMixin.check_argument_for_proper_class``). Where torchvision is missing, the entry gives the
pipeline :class:`TextPromptProcessor`, the processor's text path done by the same tokenizer (logged once);
where it is installed, the real processor is used.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from zeropipe.config.pipeline_index import read_pipeline_index
from zeropipe.families.diffusion.bases.qwen_image import QwenImageSampling, prompt_mask
from zeropipe.families.diffusion.bases.qwen_image_edit import as_transformers_processor
from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.parts import PromptText
from zeropipe.families.diffusion.parts.latents import QwenImage21Latents
from zeropipe.families.diffusion.roles import Assembly, DenoiserCall, PromptEncoding
from zeropipe.families.diffusion.sampler import pipeline_call
from zeropipe.families.diffusion.tiny.components import tiny_qwen3_vl_generation
from zeropipe.families.diffusion.tiny.tokenizers import tiny_edit_tokenizer

log = logging.getLogger(__name__)

PROCESSOR = "processor"  # the pipeline's component: Qwen3VLProcessor, whose folder holds the tokenizer
# A Qwen3-VL chat template for the tiny tokenizer: turns of typed parts (the pipeline's system message is one).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_told_about_torchvision = False


def torchvision_installed() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # ImportError, or a build that does not load beside this torch (a CUDA build on a CPU torch)
        return False
    return True


def processor_chat_template(folder: Path) -> str | None:
    """The chat template a Qwen3VLProcessor loaded from this folder uses: ``chat_template.jinja``, else the legacy ``chat_template.json``."""
    jinja, legacy = Path(folder) / "chat_template.jinja", Path(folder) / "chat_template.json"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    if legacy.is_file():
        return json.loads(legacy.read_text(encoding="utf-8")).get("chat_template")
    return None


class TextPromptProcessor:
    """What ``Qwen3VLProcessor`` does with text alone, done by its tokenizer, for machines without torchvision.

    For text without images or videos the processor (transformers 5.24, ``ProcessorMixin.__call__``,
    processing_utils.py lines 672-736) expands no placeholder and returns the tokenizer's output on the
    text (``self.tokenizer(text, **text_kwargs)``, with Qwen3-VL's ``return_token_type_ids=False``,
    processing_qwen3_vl.py lines 34-36) plus ``mm_token_type_ids`` (``return_mm_token_type_ids = True``, line 33),
    which ``create_mm_token_type_ids`` (lines 996-1026) sets to 0 on every text token. Its
    ``apply_chat_template`` (lines 2307-2453) renders the conversation with the processor's chat template and,
    with ``tokenize=True``, passes the text through ``__call__`` (a batch of one: ``prepare_inputs_layout`` wraps a
    string in a list). A text holding an image or video placeholder without its image is refused, as
    ``validate_inputs`` refuses it. ``tests/unit/diffusion/test_qwen_image21.py`` holds the results equal to the
    tokenizer's own on the same texts and messages.
    """

    image_token, video_token = "<|image_pad|>", "<|video_pad|>"

    def __init__(self, tokenizer, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template or tokenizer.chat_template

    def __call__(self, images=None, text=None, videos=None, audio=None, return_tensors=None, **text_kwargs):
        from transformers import BatchFeature

        if images is not None or videos is not None or audio is not None:
            raise ValueError(
                "Qwen-Image 2.1's prompts are encoded here without torchvision, by the processor's text path only: an image prompt "
                "(condition images) needs the real Qwen3VLProcessor: pip install torchvision"
            )
        texts = [text] if isinstance(text, str) else list(text)
        for sample in texts:
            for token in (self.image_token, self.video_token):
                if token in sample:
                    raise ValueError(f"Found {sample.count(token)} {token} tokens in the text but no images or videos were passed.")
        text_kwargs.setdefault("return_token_type_ids", False)
        encoded = dict(self.tokenizer(texts, **text_kwargs))
        # No placeholder is left in the text (refused above), so every token is text: type 0.
        encoded["mm_token_type_ids"] = [[0] * len(ids) for ids in encoded["input_ids"]]
        return BatchFeature(encoded, tensor_type=return_tensors)

    def save_pretrained(self, save_directory, **kwargs):
        """The tokenizer's files and the chat template, where Qwen3VLProcessor keeps them."""
        self.tokenizer.save_pretrained(str(save_directory))
        if self.chat_template:
            (Path(save_directory) / "chat_template.jinja").write_text(self.chat_template, encoding="utf-8")

    def apply_chat_template(self, conversation, chat_template: str | None = None, add_generation_prompt: bool = False, tokenize: bool = False,
                            return_dict: bool = False, return_tensors=None, **kwargs):
        batched = bool(conversation) and isinstance(conversation[0], (list, tuple))
        text = self.tokenizer.apply_chat_template(
            conversation if batched else [conversation], chat_template=chat_template or self.chat_template,
            add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs,
        )
        if not tokenize:
            return text if batched else text[0]
        out = self(text=text, return_tensors=return_tensors)
        return out if return_dict else out["input_ids"]


def load_processor(folder: Path):
    """The pipeline's processor from its folder: the real Qwen3VLProcessor with torchvision, else :class:`TextPromptProcessor` (logged once)."""
    global _told_about_torchvision
    from transformers import AutoTokenizer

    if torchvision_installed():
        from transformers import Qwen3VLProcessor

        return Qwen3VLProcessor.from_pretrained(str(folder))
    if not _told_about_torchvision:
        _told_about_torchvision = True
        log.info(
            "Qwen-Image 2.1: torchvision is not installed, which transformers' Qwen3VLProcessor needs (its video processor); "
            "prompts are tokenized by the processor's own tokenizer and chat template instead, as the processor does for text alone"
        )
    return text_prompt_processor(AutoTokenizer.from_pretrained(str(folder)), processor_chat_template(folder))


def text_prompt_processor(tokenizer, chat_template: str | None = None):
    """A :class:`TextPromptProcessor`, as the ProcessorMixin diffusers' from_pretrained accepts for the pipeline's processor."""
    return as_transformers_processor(TextPromptProcessor)(tokenizer, chat_template)


class QwenImage21Prompts(PromptEncoding):
    """Prompts through the pipeline's own encode_prompt; the processor (the tokenizer's folder) loaded or, for a tiny preset, written."""

    def encode_prompts(self, pipeline, prompts, device):
        embeds, mask, _ = pipeline.encode_prompt(prompt=list(prompts), device=device)
        return {"prompt_embeds": embeds, "prompt_embeds_mask": prompt_mask(embeds, mask)}

    def tiny_prompt_processor(self, processor, parts, folder):
        """The processor folder as Qwen-Image-2.1's is laid out: its tokenizer, chat template and image processor; model_index.json names Qwen3VLProcessor.

        diffusers saves the stand-in under its own class name, so the model_index.json entry is written here as the release's.
        """
        from transformers import Qwen2VLImageProcessorPil

        parts[processor].save_pretrained(folder)
        Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112).save_pretrained(str(folder))
        pipeline = read_pipeline_index(folder.parent, key=None)
        index = {**pipeline.index, processor: ["transformers", "Qwen3VLProcessor"]}
        pipeline.index_file.write_text(json.dumps(index, indent=2, sort_keys=True))

    def load_prompt_processor(self, pipeline_dir, processor, parts):
        return load_processor(Path(pipeline_dir) / processor)


class QwenImage21Assembly(Assembly):
    def tiny_component(self, name, fields):
        if name == PROCESSOR:  # the text-only processor over a tiny Qwen tokenizer; its folder is written by tiny_prompt_processor
            tokenizer = tiny_edit_tokenizer(self.record.tokenizer_length(name))
            tokenizer.chat_template = CHAT_TEMPLATE
            return text_prompt_processor(tokenizer, CHAT_TEMPLATE)
        return super().tiny_component(name, fields)

    def construct_pipeline(self, cls, kwargs, folder):
        # The pipeline reads its processor in its constructor (the system turn's length): a pipeline without text encoders still needs it.
        if kwargs.get(PROCESSOR) is None:
            kwargs = {**kwargs, PROCESSOR: load_processor(folder.path / PROCESSOR)}
        return cls(**kwargs)


class QwenImage21Call(DenoiserCall):
    def predict(self, model, model_input, timesteps, condition, context):
        """The transformer on each prompt length's rows, as ``QwenImage21Pipeline`` calls it for one prompt (text, then the target's slots)."""
        from diffusers import QwenImage21Pipeline

        batch, channels, _, height, width = model_input.shape  # one latent frame
        packed = QwenImage21Pipeline._pack_latents(model_input, batch, channels, height, width)
        embeds, mask = condition["prompt_embeds"].to(context.dtype), condition["prompt_embeds_mask"]
        lengths = mask.sum(dim=1).tolist()
        out = packed.new_empty(batch, height * width, channels)
        for length in sorted(set(lengths)):
            rows = [row for row, count in enumerate(lengths) if count == length]
            # One slot per 2x2 group of the target's latent tokens after the text, as the pipeline's append_target_slots.
            img_mask = torch.cat([torch.zeros(1, int(length), dtype=torch.bool), torch.ones(1, height * width // 4, dtype=torch.bool)], dim=1).to(packed.device)
            out[rows] = model(
                hidden_states=packed[rows], encoder_hidden_states=embeds[rows, : int(length)], timestep=(timesteps[rows] / 1000).to(context.dtype),
                img_shapes=[[(1, height, width)]] * len(rows), img_mask=img_mask.expand(len(rows), -1), return_dict=False,
            )[0][:, -height * width :]
        return QwenImage21Pipeline._unpack_latents(out, height * context.vae_factor, width * context.vae_factor, context.vae_factor)

    def trace_inputs(self, config, latent, latent_frames, text_tokens, dtype):
        # Not traced: the transformer lays out its joint sequence from its masks' values (img_mask.tolist() in its rotary
        # embedding, nonzero() in build_token_metadata), which tensors on the meta device the planner traces on do not have.
        return None


class QwenImage21Sampling(QwenImageSampling):
    """Qwen-Image's sampling arguments (true classifier-free guidance), through the pipeline's own call."""

    def draw(self, pipeline, kwargs):
        configured = pipeline.config.get("sample_sigmas")
        if configured and "sigmas" not in kwargs and len(configured) != kwargs.get("num_inference_steps", len(configured)):
            log.info(
                "Qwen-Image 2.1 samples use the %d steps of the pipeline's sample_sigmas (model_index.json), not generate.sample_steps %s",
                len(configured), kwargs.get("num_inference_steps"),
            )
        return pipeline_call(pipeline, kwargs)[0]


ARCHITECTURE = Architecture(
    record=Record(
        name="qwen-image-2.1",
        pipeline_class="QwenImage21Pipeline",
        denoiser="transformer",
        denoiser_class="QwenImage21Transformer2DModel",
        objective="flow",
        text_encoders=("text_encoder",),
        tokenizers=(),  # the tokenizer is the processor's (processor/), loaded with it
        patch_factor=2,  # latent sides even: each image slot of the prompt stands for 2x2 latent tokens
        codec=QwenImage21Latents(vae_class="AutoencoderKLQwenImage21"),
        text=PromptText(processors=(PROCESSOR,)),
        preset_name="tiny-qwen-image-2.1",
        preset={
            "transformer": {
                "patch_size": 1, "in_channels": 16, "out_channels": 16, "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
                "context_in_dim": 32, "mlp_ratio": 2, "axes_dims_rope": [4, 6, 6],
            },
            # The release's four spatial halvings (the pipeline fixes its VAE factor at 16), at 16 channels: 64-pixel images are 4x4 latents
            # of 16 channels (the release: 64); RGBA in and out.
            "vae": {
                "base_dim": 16, "decoder_base_dim": 16, "z_dim": 16, "dim_mult": [1, 1, 1, 1, 1], "num_res_blocks": 1, "temperal_downsample": [False, True, True, True],
                "latents_mean": [0.0] * 16, "latents_std": [1.0] * 16,
            },
            "text_encoder": tiny_qwen3_vl_generation(),
            "processor": {},
            # The release shifts with the resolution (use_dynamic_shifting); the tiny one samples with a fixed shift.
            "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False},
        },
        # Every linear layer of the blocks, their attention and SwiGLU (diffusion-pipe's qwen_image21 adapts the whole QwenImage21TransformerBlock).
        lora_targets=("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.proj", "img_mlp.gate_layer", "img_mlp.out"),
        tokenizer_lengths={PROCESSOR: 1024},  # the processor's tokenizer in a tiny preset
        trace_tokens=256,  # a long caption (its tokenizer is the processor's, not one of the entry's tokenizers)
        image_processor_patch=2,  # the pipeline rounds sizes to twice its VAE factor (2x2 latent tokens per image slot)
    ),
    call=QwenImage21Call(),
    prompts=QwenImage21Prompts(),
    sampling=QwenImage21Sampling(),
    assembly=QwenImage21Assembly(),
)

__all__ = ["ARCHITECTURE", "TextPromptProcessor"]
