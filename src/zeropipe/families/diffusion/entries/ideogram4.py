"""Ideogram 4: a 9.3B single-stream DiT on FLUX.2's VAE, conditioned on thirteen tapped layers of Qwen3-VL-8B, guided by a second transformer.

What ``Ideogram4Pipeline`` does, and what the entry takes from it:

- **Latents.** The VAE is FLUX.2's (``AutoencoderKLFlux2``, 32 channels); the pipeline folds each
  2x2 latent patch into one token of 128 channels ordered (patch row, patch column, channel), and
  normalises them by the batch-norm statistics the VAE keeps as weights, in that order. The codec
  keeps them as (batch, 128, rows, columns) in the same channel order, so the statistics apply per
  channel; ``predict`` lays them out as tokens.
- **Prompts.** ``encode_prompt`` wraps each prompt in the tokenizer's chat template, runs the text
  encoder's decoder layers by hand and concatenates layers 0, 3, ..., 33 and 35 (13 x 4096 = 53248
  features per token), left-padded to ``max_sequence_length`` and packed before the image tokens.
  The cache keeps each caption's features at its own length (the encoding batch's longest, with a
  mask; about 21 MB per 100-token caption in fp32 at the real size), taken from the pipeline's own
  ``encode_prompt`` output by its ``indicator``.
- **The denoiser call.** One packed sequence ``[left padding][text][image]`` per example, built
  by the pipeline's own ``_prepare_ids`` (3-axis positions, block-diagonal segments, token roles).
  Padding is a segment of its own, so a caption's prediction does not depend on its batch's
  padding. The transformer's time runs the other way (1 = data) and it predicts data - noise:
  ``predict`` gives it ``1 - sigma`` and negates its output, so the objective is the shared
  rectified flow (target noise - data).
- **Guidance.** Ideogram 4's classifier-free guidance is asymmetric: a second full transformer
  (``unconditional_transformer``, as large as the first) denoises the image tokens alone, and the
  pipeline blends ``g * conditional + (1 - g) * unconditional``. Training adapts the conditional
  ``transformer`` only (as diffusion-pipe and ai-toolkit do); the unconditional one is a frozen part
  of the folder and of every export, so ``Ideogram4Pipeline`` loading an export guides as it should.
  **Samples during training are drawn unguided** (g = 1: the conditional transformer alone, the
  pipeline's formula with the unconditional term's weight 0): holding the second 9.3B transformer
  on every rank for previews would cost its whole size per GPU, and running the trained transformer
  on the text-free sequence would give a velocity it was never trained to give. ``Ideogram4Sampling.draw`` is
  the pipeline's loop with its own pieces (``_resolution_aware_mu``, ``_logit_normal_sigmas``,
  ``prepare_latents``, the scheduler), fed the cached conditioning; called with a prompt string it
  is the pipeline's own ``__call__``.

The LoRA's original layout is ai-toolkit's, which ``Ideogram4Pipeline.load_lora_weights`` converts:
``diffusion_model.layers.N.attention.qkv`` (q, k and v fused, rank 3r, block-diagonal),
``attention.o``, ``feed_forward.w1/w2/w3``, the strength folded into ``lora_B``.
"""

from __future__ import annotations

import logging

import torch

from zeropipe.errors import ConfigError
from zeropipe.families.diffusion.comfy import COMFY_PREFIX
from zeropipe.families.diffusion.core import Architecture, PredictContext, Record
from zeropipe.families.diffusion.parts.latents import Ideogram4Latents
from zeropipe.families.diffusion.roles import DenoiserCall, ExportLayouts, PromptEncoding, Sampling
from zeropipe.families.diffusion.sampler import denoise
from zeropipe.families.diffusion.tiny.components import tiny_flux2_vae, tiny_ideogram4_transformer, tiny_qwen3_vl
from zeropipe.families.diffusion.tiny.tokenizers import character_qwen_tokenizer

log = logging.getLogger(__name__)

PATCH = 2  # the pipeline folds 2x2 latent patches into a token
MAX_TEXT_TOKENS = 2048  # Ideogram4Pipeline's max_sequence_length: a longer caption is refused by its encode_prompt
# The pipeline's defaults for its logit-normal sampling schedule (__call__'s mu and std).
SCHEDULE_MU, SCHEDULE_STD = 0.0, 1.5
# A Qwen3-VL chat template for the tiny tokenizer: a user turn of typed parts, as the pipeline writes its messages.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Diffusers' module of a block -> ai-toolkit's fused layer and the part of it (q, k, v: 0, 1, 2).
ORIGINAL_NAMES = {
    "attention.to_q": ("attention.qkv", 0), "attention.to_k": ("attention.qkv", 1), "attention.to_v": ("attention.qkv", 2),
    "attention.to_out.0": ("attention.o", None), "feed_forward.w1": ("feed_forward.w1", None), "feed_forward.w2": ("feed_forward.w2", None),
    "feed_forward.w3": ("feed_forward.w3", None), "adaln_modulation": ("adaln_modulation", None),
}


def to_tokens(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, rows, columns) -> (B, rows x columns, C), row-major as the pipeline's image positions."""
    return latents.flatten(2).transpose(1, 2)


def from_tokens(tokens: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    return tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], rows, columns)


class Ideogram4Prompts(PromptEncoding):
    def tiny_tokenizer(self, tokenizer):
        made = character_qwen_tokenizer(self.record.tokenizer_length(tokenizer))
        made.chat_template = CHAT_TEMPLATE
        return made

    def encode_prompts(self, pipeline, prompts, device):
        """The pipeline's ``encode_prompt``, its text rows moved to the front of each caption's row (the cache pads at the end, with a mask).

        The pipeline left-pads every prompt to ``max_sequence_length`` (53248 features per token at the
        real size): it is asked for the batch's longest prompt, counted with its own chat template.
        """
        from diffusers.models.transformers.transformer_ideogram4 import LLM_TOKEN_INDICATOR

        tokenizer = pipeline.tokenizer
        lengths = []
        for prompt in prompts:  # the pipeline's own formatting (Ideogram4Pipeline.encode_prompt), counted to size its padding
            text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": prompt}]}], add_generation_prompt=True, tokenize=False)
            lengths.append(len(tokenizer(text, add_special_tokens=False)["input_ids"]))
        too_long = [(count, prompt) for count, prompt in zip(lengths, prompts) if count > MAX_TEXT_TOKENS]
        if too_long:  # the pipeline's encode_prompt would refuse it without naming the caption
            count, prompt = too_long[0]
            raise ConfigError([("data.path", f"a caption is {count} tokens in Ideogram 4's chat template, more than its {MAX_TEXT_TOKENS} "
                                             f"(Ideogram4Pipeline's max_sequence_length): shorten it ({prompt[:80]!r}...)")])
        length = max(lengths)
        features, _, _, indicator = pipeline.encode_prompt(prompt=list(prompts), grid_h=1, grid_w=1, max_sequence_length=length, device=device)
        text = indicator[:, :length] == LLM_TOKEN_INDICATOR
        embeds = features.new_zeros(len(prompts), length, features.shape[-1])
        mask = torch.zeros(len(prompts), length, dtype=torch.long, device=features.device)
        for row, keep in enumerate(text):
            count = int(keep.sum())
            embeds[row, :count] = features[row, :length][keep]
            mask[row, :count] = 1
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}


class Ideogram4Call(DenoiserCall):
    """The transformer on one packed ``[left padding][text][image]`` sequence per example; ``predict`` reads the image tokens back as the flow.

    Not traced (no ``trace_batch``): Ideogram4MRoPE opens torch.autocast(enabled=False) on its inputs' device (its image
    positions start at 65536, which bf16 cannot count), and torch refuses autocast on the meta device the planner traces on
    ("unsupported scalarType").
    """

    def packed_inputs(self, tokens: torch.Tensor, embeds: torch.Tensor, mask: torch.Tensor, rows: int, columns: int) -> dict[str, torch.Tensor]:
        """The transformer's packed ``[left padding][text][image]`` inputs, laid out by the pipeline's own ``_prepare_ids``."""
        from diffusers import Ideogram4Pipeline

        lengths = [int(count) for count in mask.sum(dim=1).tolist()]
        longest = max(lengths)
        batch, image_tokens = tokens.shape[0], tokens.shape[1]
        position_ids, segment_ids, indicator = Ideogram4Pipeline._prepare_ids(lengths, rows, columns, longest, tokens.device)
        text = embeds.new_zeros(batch, longest + image_tokens, embeds.shape[-1])
        for row, count in enumerate(lengths):  # the cache holds each caption's rows first; the pipeline puts them just before the image
            text[row, longest - count : longest] = embeds[row, :count]
        hidden = torch.cat([tokens.new_zeros(batch, longest, tokens.shape[-1]), tokens], dim=1)
        return {"hidden_states": hidden, "encoder_hidden_states": text, "position_ids": position_ids, "segment_ids": segment_ids, "indicator": indicator}

    def inputs(self, model_input, timesteps, condition, context):
        _, _, rows, columns = model_input.shape
        inputs = self.packed_inputs(to_tokens(model_input), condition["prompt_embeds"].to(context.dtype), condition["prompt_embeds_mask"], rows, columns)
        inputs["hidden_states"] = inputs["hidden_states"].to(context.dtype)
        # The transformer's time is 1 - sigma (1 = clean data) and it predicts data - noise: the flow's target negated.
        inputs["timestep"] = (1.0 - timesteps / 1000).to(context.dtype)
        return inputs

    def predict(self, model, model_input, timesteps, condition, context):
        _, _, rows, columns = model_input.shape
        out = model(**self.inputs(model_input, timesteps, condition, context), return_dict=False)[0]
        return -from_tokens(out[:, -rows * columns :], rows, columns)


class Ideogram4Sampling(Sampling):
    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        # No negative: the pipeline's guidance is a second transformer, not a negative prompt (see the module's docstring).
        return {"prompt_embeds": condition["prompt_embeds"], "prompt_embeds_mask": condition["prompt_embeds_mask"], "guidance_scale": guidance_scale}

    @torch.no_grad()
    def draw(self, pipeline, kwargs):
        """Ideogram4Pipeline's denoising steps, in the shared loop (``sampler.denoise``), on the cached conditioning, unguided; with a prompt string, the pipeline's own call.

        The pipeline takes no precomputed prompt features (it always runs its 8B text encoder), so
        samples during training run its loop step for step: the same noise (``prepare_latents``), the
        same resolution-aware logit-normal sigmas, the same scheduler steps, with the conditional
        velocity alone (its blend at guidance 1: the unconditional transformer is not held by the ranks).
        """
        if "prompt" in kwargs:
            return pipeline(**kwargs)[0]
        from diffusers.pipelines.ideogram4.pipeline_ideogram4 import _logit_normal_sigmas, _resolution_aware_mu

        if kwargs.get("guidance_scale", 1.0) != 1.0:
            log.info(
                "Ideogram 4 samples during training are drawn unguided, by the trained transformer alone: generate.guidance_scale %s is not "
                "applied (its guidance runs the second, unconditional transformer, which the ranks do not load)", kwargs["guidance_scale"],
            )
        embeds, mask = kwargs["prompt_embeds"], kwargs["prompt_embeds_mask"]
        height, width, steps = kwargs["height"], kwargs["width"], kwargs["num_inference_steps"]
        transformer, scheduler = pipeline.transformer, pipeline.scheduler
        device = embeds.device
        factor = pipeline.vae_scale_factor * pipeline.patch_size
        rows, columns = height // factor, width // factor
        latents = pipeline.prepare_latents(embeds.shape[0], rows * columns, transformer.config.in_channels, torch.float32, device, kwargs.get("generator"))
        sigmas = _logit_normal_sigmas(steps, _resolution_aware_mu(height=height, width=width, base_mu=SCHEDULE_MU), std=SCHEDULE_STD, device=device)
        scheduler.set_timesteps(sigmas=sigmas.tolist(), device=device)
        context = PredictContext(device, transformer.dtype, pipeline.vae_scale_factor, 1.0)
        condition = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

        def model_output(index, t, latents):
            # predict gives the flow (noise - data), the pipeline's -v; its time is t / num_train_timesteps as the pipeline's.
            times = (t.float() * 1000 / scheduler.config.num_train_timesteps).expand(latents.shape[0])
            flow = self.entry.call.predict(transformer, from_tokens(latents, rows, columns), times, condition, context)
            return to_tokens(flow).float()

        return denoise(scheduler, latents, scheduler.timesteps, model_output)

    def unpack_latents(self, pipeline, latents, size, vae_factor):
        side = size // (vae_factor * PATCH)
        return from_tokens(latents, side, side)


class Ideogram4Layouts(ExportLayouts):
    def original_lora_layout(self, layers, alpha):
        """ai-toolkit's names under ``diffusion_model.`` (q/k/v fused into a rank-3r ``attention.qkv``), alpha / r folded into ``lora_B``."""
        groups: dict[str, dict[int | None, str]] = {}
        for module in sorted({key.partition(".lora_")[0] for key in layers}):
            block, _, inner = module.partition(".")
            number, _, name = inner.partition(".")
            if block != "layers" or name not in ORIGINAL_NAMES:
                raise ValueError(f"Ideogram 4's original LoRA layout has no name for {module} (it covers the blocks' {', '.join(ORIGINAL_NAMES)})")
            original, part = ORIGINAL_NAMES[name]
            groups.setdefault(f"layers.{number}.{original}", {})[part] = module
        out: dict[str, torch.Tensor] = {}
        for original, parts in groups.items():
            downs = {part: layers[f"{module}.lora_A.weight"] for part, module in parts.items()}
            ups = {part: layers[f"{module}.lora_B.weight"] * (alpha / downs[part].shape[0]) for part, module in parts.items()}
            if None in parts:
                down, up = downs[None], ups[None]
            else:  # each part's B in its rows and its own columns: converted back (A shared, B split in thirds) each part is its own change
                order = sorted(parts)
                down = torch.cat([downs[part] for part in order])
                inner = ups[order[0]].shape[0]
                up = down.new_zeros(3 * inner, down.shape[0])
                column = 0
                for part in order:
                    up[part * inner : (part + 1) * inner, column : column + ups[part].shape[1]] = ups[part]
                    column += ups[part].shape[1]
            out[f"{COMFY_PREFIX}{original}.lora_A.weight"] = down.contiguous()
            out[f"{COMFY_PREFIX}{original}.lora_B.weight"] = up.contiguous()
        return out



ARCHITECTURE = Architecture(
    record=Record(
        name="ideogram4",
        pipeline_class="Ideogram4Pipeline",
        denoiser="transformer",
        denoiser_class="Ideogram4Transformer2DModel",
        objective="flow",
        text_encoders=("text_encoder",),
        tokenizers=("tokenizer",),
        patch_factor=PATCH,
        codec=Ideogram4Latents(vae_class="AutoencoderKLFlux2"),
        preset_name="tiny-ideogram4",
        preset={
            "transformer": tiny_ideogram4_transformer(),
            # The second transformer of the pipeline's guidance: frozen, never trained, kept in the folder and its exports.
            "unconditional_transformer": tiny_ideogram4_transformer(),
            "vae": tiny_flux2_vae(),
            # Qwen3-VL at 36 layers of 16: the pipeline taps layers 0, 3, ... 33 and 35.
            "text_encoder": tiny_qwen3_vl(),
            # The pipeline sets its own logit-normal sigmas; the scheduler only steps them.
            "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False},
        },
        # The attention and the SwiGLU of every block, as ai-toolkit's Ideogram 4 LoRAs (and diffusers' converter of them) have them.
        lora_targets=("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"),
        tokenizer_lengths={"tokenizer": MAX_TEXT_TOKENS},
        trace_tokens=256,  # a long caption; each prompt keeps its own length
        image_processor_patch=PATCH,
    ),
    call=Ideogram4Call(),
    prompts=Ideogram4Prompts(),
    sampling=Ideogram4Sampling(),
    layouts=Ideogram4Layouts(),
)

__all__ = ["ARCHITECTURE"]
