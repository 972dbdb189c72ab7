"""Cosmos 3 Omni (``cosmos3``; ``Cosmos3OmniPipeline``, diffusers 0.42.1): text-to-video (and text-to-image, one frame).

``Cosmos3OmniTransformer`` is one Mixture-of-Transformers model over a packed sequence of a single item: the prompt's
token ids (embedded by the transformer itself: there is no separate text encoder), which run the "understanding"
pathway, followed by the noisy VAE latents (Wan 2.2's ``AutoencoderKLWan``, 48 channels, patched 2x2) on the
"generation" pathway, with 3-D mRoPE positions over both and the flow timestep per noisy patch (scaled by
``timestep_scale``). Its output per item is the velocity ``noise - x0`` that the UniPC flow scheduler steps on.

The segments are built by the pipeline's own helpers (``Cosmos3OmniPipeline._prepare_text_segment`` and
``_prepare_vision_segment``, which the modular blocks ``Cosmos3PrepareTextSegmentsStep`` and
``Cosmos3VisionPackSequenceStep`` call) on the transformer's config, so this call is ``Cosmos3LoopDenoiser``'s
conditional pass (held to it in ``tests/unit/diffusion/test_cosmos3.py``). The model takes one item per call: a batch
is called one example at a time, each prompt cut to its own tokens by the cache's mask.

The prompt: the pipeline's ``tokenize_prompt`` appends the clip's duration, frame rate and resolution to the caption and
puts it under a system prompt for an image or a video, so the token ids depend on the clip: the prompt part
``PromptPerClip`` (``parts/clip_prompt.py``) caches them per (caption, clip shape), tokenized by that method
(``Cosmos3Prompts.encode_prompts_for_clips``). A dropped caption trains on the clip's negative prompt (the empty one with
the inverse templates), the unconditional pass of the pipeline's guidance.

The latents are Wan 2.2's, normalised per channel by the VAE config's ``latents_mean`` / ``latents_std`` exactly as the
pipeline's ``_encode_video`` does (``PerChannelVideoLatents``; the cache keeps the distribution and a latent is drawn
per step, as for every Wan entry, where the pipeline's own encoding takes its mode for conditioning frames).

Samples are the pipeline's loop in ``sampler.denoise`` (``Cosmos3Sampling``): its noise, its timesteps, guidance as it
writes it (``uncond + scale * (cond - uncond)``, the negative prompt with the inverse templates), held to
``Cosmos3OmniPipeline.__call__`` in the test. LoRA adapts the generation pathway's attention (``add_q_proj``,
``add_k_proj``, ``add_v_proj``, ``to_add_out``); the understanding pathway, which reads the prompt, stays as released.

Not built (docs/video.md): image-conditioned frames (image-to-video, video-to-video), the sound stream
(``Cosmos3AVAEAudioTokenizer``), actions, and a ComfyUI layout (no peer names one).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from zeropipe.families.diffusion.core import Architecture, PredictContext, Record
from zeropipe.families.diffusion.parts import PerChannelVideoLatents
from zeropipe.families.diffusion.parts.clip_prompt import PromptPerClip
from zeropipe.families.diffusion.roles import Assembly, DenoiserCall, PromptEncoding, Sampling
from zeropipe.families.diffusion.tiny.tokenizers import QWEN3_CHAT_TEMPLATE, VISION_TOKENS, character_qwen_tokenizer

TEMPORAL_FACTOR = 4  # Wan 2.2's VAE: 4 frames per latent frame (the pipeline's vae_scale_factor_temporal)


def segments(config, input_ids: list[int], latents: torch.Tensor, fps: float, device) -> tuple[dict, dict]:
    """The text and vision segments of one item, by the pipeline's own helpers (``latents``: (1, C, T, H, W), no condition frame)."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import Cosmos3OmniPipeline

    owner = SimpleNamespace(transformer=SimpleNamespace(config=config), vae_scale_factor_temporal=TEMPORAL_FACTOR)
    text = Cosmos3OmniPipeline._prepare_text_segment(owner, input_ids, device)
    vision = Cosmos3OmniPipeline._prepare_vision_segment(
        owner, input_vision_tokens=latents, has_image_condition=False, mrope_offset=text["vision_start_temporal_offset"],
        vision_fps=fps, curr=text["und_len"], device=device, condition_frame_indexes=[],
    )
    return text, vision


class Cosmos3Call(DenoiserCall):
    """``Cosmos3LoopDenoiser``'s conditional pass on vision latents (B, C, T, H, W): one call per example.

    ``condition``: ``input_ids`` (the prompt's token ids, padded) with ``input_ids_mask``, and ``fps`` (one per example;
    24 where absent, the pipeline's default).
    """

    def inputs_one(self, config, latents: torch.Tensor, timestep, input_ids: list[int], fps: float, dtype: torch.dtype, device) -> dict:
        """The transformer's keyword arguments for one item (``latents``: (1, C, T, H, W)), packed by the pipeline's segment helpers."""
        text, vision = segments(config, input_ids, latents, fps, device)
        return dict(
            input_ids=text["input_ids"], text_indexes=text["text_indexes"],
            position_ids=torch.cat([text["text_mrope_ids"], vision["vision_mrope_ids"]], dim=1),
            und_len=text["und_len"], sequence_length=text["und_len"] + vision["num_vision_tokens"],
            vision_tokens=[latents.to(dtype)], vision_token_shapes=vision["vision_token_shapes"],
            vision_sequence_indexes=vision["vision_sequence_indexes"], vision_mse_loss_indexes=vision["vision_mse_loss_indexes"],
            vision_timesteps=torch.full((vision["num_noisy_vision_tokens"],), float(timestep), device=device),
            vision_noisy_frame_indexes=vision["vision_noisy_frame_indexes"], return_dict=False,
        )

    def call_one(self, model, latents: torch.Tensor, timestep: torch.Tensor, input_ids: list[int], fps: float, context) -> torch.Tensor:
        config = getattr(model, "module", model).config
        out = model(**self.inputs_one(config, latents, timestep, input_ids, fps, context.dtype, latents.device))
        return out[0][0]  # the item's (1, C, T, H, W) velocity: every frame noisy, nothing masked

    def trace_inputs(self, config, latent_side, latent_frames, text_tokens, dtype):
        """One item's keyword arguments at the traced size, on the meta device: a prompt of ``text_tokens`` ids, a clip of
        ``latent_frames`` x ``latent_side``² latents, packed by the pipeline's segment helpers as ``inputs_one`` packs them.

        The helpers read index tensors back into Python (``.tolist()``), which a meta tensor cannot give: they run on the CPU on
        an empty latent of the clip's shape (the indexes and positions are a few integers per token), and every tensor is then
        moved to the meta device. The transformer switches autocast off for its position ids' device (``torch.autocast("meta")``,
        which torch refuses): the planner's trace makes that a no-op on the meta device (``plan.trace``)."""
        with torch.device("cpu"):  # inside the planner's meta device context: the helpers' own tensors too
            latents = torch.empty(1, config.latent_channel, latent_frames, latent_side, latent_side, dtype=dtype)
            made = self.inputs_one(config, latents, 500.0, [0] * text_tokens, 24.0, dtype, torch.device("cpu"))

        def to_meta(value):
            if isinstance(value, torch.Tensor):
                return value.to("meta")
            return [to_meta(item) for item in value] if isinstance(value, list) else value

        return {key: to_meta(value) for key, value in made.items()}

    def predict(self, model, model_input, timesteps, condition, context):
        ids, mask = condition["input_ids"], condition["input_ids_mask"].bool()
        fps = condition.get("fps")
        return torch.cat([
            self.call_one(model, model_input[index : index + 1], timesteps[index], ids[index][mask[index]].tolist(),
                          24.0 if fps is None else float(fps[index]), context)
            for index in range(model_input.shape[0])
        ])


class Cosmos3Prompts(PromptEncoding):
    """The prompt's token ids, by the pipeline's own ``tokenize_prompt``; the text cache's entries are made by ``PromptPerClip``."""

    def encode_prompts(self, pipeline, prompts, device):
        raise TypeError("Cosmos 3's token ids depend on the clip's shape: its prompt part (PromptPerClip) tokenizes them with encode_prompts_for_clips")

    def encode_prompts_for_clips(self, pipeline, text: str, width: int, height: int, frames: int, fps: float) -> tuple[list[int], list[int]]:
        """(the caption's ids, the empty negative prompt's) on a clip of this shape: ``Cosmos3OmniPipeline.tokenize_prompt``, templates on."""
        return pipeline.tokenize_prompt(text, "", num_frames=frames, height=height, width=width, fps=fps)

    def tiny_tokenizer(self, tokenizer):
        """A Qwen2 tokenizer of single characters with the vision tokens (``<|vision_start|>`` opens the generation) and a chat template with a system turn."""
        made = character_qwen_tokenizer(self.record.tokenizer_length(tokenizer), extra_tokens=VISION_TOKENS, extra_characters="()")
        made.chat_template = QWEN3_CHAT_TEMPLATE
        return made


class Cosmos3Sampling(Sampling):
    """``Cosmos3OmniPipeline.__call__``'s text-to-video loop in the shared sampler, one prompt at a time (the pipeline takes one), on the cached ids."""

    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        return {"condition": condition, "negative": negative, "guidance_scale": guidance_scale}

    @torch.no_grad()
    def draw(self, pipeline, kwargs):
        """Latents (B, C, T, h, w): per prompt the pipeline's noise (``randn_tensor`` of the clip's latent shape, float32), its timesteps,
        the conditional and (guidance scale not 1) unconditional passes blended as it blends them, its scheduler's steps."""
        if "prompt" in kwargs:  # a prompt string (the UI's Draw): the pipeline's own call, which tokenizes it
            from zeropipe.families.diffusion.sampler import pipeline_call

            return pipeline_call(pipeline, kwargs)[0]
        import numpy as np
        from diffusers.utils.torch_utils import randn_tensor

        from zeropipe.families.diffusion.sampler import denoise

        transformer, scheduler = pipeline.transformer, pipeline.scheduler
        module = getattr(transformer, "module", transformer)
        parameter = next(module.parameters())
        device, dtype = parameter.device, parameter.dtype
        condition, negative, scale = kwargs["condition"], kwargs["negative"], float(kwargs["guidance_scale"])
        frames = int(kwargs.get("num_frames") or 1)
        factor = pipeline.vae_scale_factor_spatial
        shape = (1, module.config.latent_channel, (frames - 1) // pipeline.vae_scale_factor_temporal + 1, kwargs["height"] // factor, kwargs["width"] // factor)
        steps = int(kwargs["num_inference_steps"])
        context = PredictContext(device, dtype, factor, 1.0)
        drawn = []
        for number in range(condition["input_ids"].shape[0]):
            latents = randn_tensor(shape, generator=kwargs.get("generator"), device=device, dtype=torch.float32)
            if pipeline.config.use_native_flow_schedule:
                sigmas = np.linspace(1.0 - 1.0 / scheduler.config.num_train_timesteps, 0.0, steps + 1)[:-1]
                scheduler.set_timesteps(steps, device=device, sigmas=sigmas)
            else:
                scheduler.set_timesteps(steps, device=device)
            prompts = [(rows["input_ids"][number][rows["input_ids_mask"][number].bool()].tolist(), float(rows["fps"][number])) for rows in (condition, negative)]

            def model_output(index, t, current, prompts=prompts):
                cond = self.entry.call.call_one(transformer, current, t, prompts[0][0], prompts[0][1], context).float()
                if scale == 1.0:
                    return cond
                uncond = self.entry.call.call_one(transformer, current, t, prompts[1][0], prompts[1][1], context).float()
                return uncond + scale * (cond - uncond)

            drawn.append(denoise(scheduler, latents, scheduler.timesteps, model_output))
        return torch.cat(drawn)


class Cosmos3Assembly(Assembly):
    def construct_pipeline(self, cls, kwargs, folder):
        """``Cosmos3OmniPipeline.__init__`` reads the VAE's normalisation and the tokenizer's special tokens even where neither is loaded
        (a text pipeline has no VAE, a denoising one no tokenizer): the VAE is built from its config on the meta device and the tokenizer
        loaded (small), then the VAE is taken out again, so nothing runs on it."""
        import diffusers
        import transformers

        given = dict(kwargs)
        if given.get("text_tokenizer") is None:
            given["text_tokenizer"] = transformers.AutoTokenizer.from_pretrained(str(folder.path / "text_tokenizer"))
        if given.get("vae") is not None:
            return cls(**given)
        with torch.device("meta"):
            given["vae"] = getattr(diffusers, self.record.codec.vae_class).from_config(folder.component_config("vae"))
        pipeline = cls(**given)
        pipeline.register_modules(vae=None)
        return pipeline


def tiny_preset() -> dict:
    from zeropipe.families.diffusion.bases.wan_ti2v import tiny_preset as ti2v_preset

    ti2v = ti2v_preset()
    return {
        # Cosmos3OmniTransformer's layout, tiny: 48 latent channels in 2x2 patches (192 per token), grouped-query attention, mRoPE axes.
        "transformer": {
            "head_dim": 16, "hidden_size": 32, "intermediate_size": 64, "latent_channel": LATENT_CHANNELS, "patch_latent_dim": 4 * LATENT_CHANNELS,
            "num_attention_heads": 2, "num_hidden_layers": 2, "num_key_value_heads": 1, "vocab_size": 256, "rope_axes_dim": [4, 2, 2], "dtype": "float32",
        },
        "vae": ti2v["vae"],  # the Wan 2.2 VAE, tiny (bases/wan_ti2v.py)
        # The pipeline's scheduler class (UniPC on flow sigmas); no published scheduler config is stored here: TI2V-5B's (flow shift 5).
        "scheduler": ti2v["scheduler"],
    }


LATENT_CHANNELS = 48  # the Wan 2.2 VAE's z_dim, the transformer's latent_channel

ARCHITECTURE = Architecture(
    record=Record(
        name="cosmos3",
        pipeline_class="Cosmos3OmniPipeline",
        denoiser="transformer",
        denoiser_class="Cosmos3OmniTransformer",
        objective="flow",
        text_encoders=(),
        tokenizers=("text_tokenizer",),
        patch_factor=2,
        codec=PerChannelVideoLatents(vae_class="AutoencoderKLWan", frame_multiple=4, frame_rate=24.0),
        text=PromptPerClip(),
        preset_name="tiny-cosmos3",
        preset=tiny_preset(),
        # The generation pathway's attention; the understanding pathway reads the prompt, the role a frozen text encoder has elsewhere.
        lora_targets=("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
        trace_frames=189,  # the pipeline's default clip: 189 frames (7.9 s at 24 fps)
        tokenizer_lengths={"text_tokenizer": 512},
        trace_tokens=128,  # a caption with the system prompt and the clip's templates
        # No NVIDIA guardrail here (cosmos_guardrail is not installed): the pipeline is built without its safety checker.
        pipeline_kwargs={"enable_safety_checker": False},
    ),
    call=Cosmos3Call(),
    prompts=Cosmos3Prompts(),
    sampling=Cosmos3Sampling(),
    assembly=Cosmos3Assembly(),
)


__all__ = ["ARCHITECTURE", "Cosmos3Assembly", "Cosmos3Call", "Cosmos3Prompts", "Cosmos3Sampling", "segments"]
