"""Kandinsky 6.0 Video (``Kandinsky6TI2VAPipeline``, diffusers 0.42.1): video and its 44.1 kHz sound from one fused transformer.

``Kandinsky6Transformer3DModel`` runs, in each of its fused blocks, a video stream (HunyuanVideo's VAE: 16 channels,
4x in time, 8x in space, channels-last latents patchified 1x2x2 by the transformer) and an audio stream (``MMAudioVAE``
latents of a log-mel spectrogram, one per 1024 samples at 44.1 kHz, (length, channels)), each with its own text
branch over the same Qwen2.5-VL tokens and CLIP pooled embedding, and cross-attention between the two streams. The
pipeline calls it once per step for both streams, at one timestep (``Kandinsky6Call.joint_predict`` calls it the same
way; held to the pipeline's call in ``tests/unit/diffusion/test_kandinsky6.py``):

- the video input is ``[latents | zeros | mask]`` (``visual_cond``: 33 channels, the condition channels zero and the
  mask zero in text-to-video);
- the prompt is Qwen2.5-VL's last hidden state of the pipeline's chat template, the first 129 tokens (the template)
  cut off, padded to ``max_sequence_length`` (1024) with a padding mask, and CLIP-L's pooled output;
- the timestep is the flow scheduler's (``sigma * 1000``); the model predicts ``noise - x0`` for both streams (the
  pipeline steps video and audio with copies of one ``FlowMatchEulerDiscreteScheduler``), so the objective is the
  shared rectified flow and the audio is noised at the video's level.

Training (no Kandinsky 6 trainer is published): the video and the audio velocity errors added, both streams at the
clip's noise level, as ltx-trainer trains LTX-2's two streams. The audio is the ``MMAudioTrack`` condition's
(``parts/mmaudio_track.py``): each clip's mono sound through the pipeline's ``audio_vae``, scaled by its
``scaling_factor``. Samples are the pipeline's own call, one prompt per call with its embeddings cut to the prompt's
length (the call takes no padding mask: cut, a prompt is what the pipeline's own encoding gives with its mask), and
come back with their sound muxed in (``audio_vae`` then ``vocoder``). The LoRA's ComfyUI layout is ``Kandinsky6Layouts``'s.

Image-to-video (``Kandinsky6I2VCall``, the ``kandinsky6-i2v`` entry): the pipeline appends the image's latents as an extra,
clean tail frame, marked by the mask channel and token type 1 and placed at the first frame's rotary position; every
frame of the clip is denoised (the tail frame is reference, not output), so the loss is over the clip's frames.

Not trained: the pi-Flow distilled checkpoints (``-distill-``: the transformer's output widened to ``PiflowScheduler``'s grids,
``policy_head``), refused naming ``model.path`` with why and what to train instead (``Kandinsky6Call.checkpoint_problems``;
``tests/unit/diffusion/test_kandinsky6_distilled.py``).
"""

from __future__ import annotations

import math

import torch

from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.parts import PromptText
from zeropipe.families.diffusion.parts.latents import SoundingVideoLatents
from zeropipe.families.diffusion.parts.mmaudio_track import MMAudioTrack
from zeropipe.families.diffusion.tiny.components import clip_text, tiny_hunyuan_video_vae, tiny_qwen2_5_vl
from zeropipe.families.diffusion.roles import ExportLayouts, PromptEncoding, Sampling, SoundingCall

PROMPT_TOKENS = 1024  # the pipeline's max_sequence_length: every prompt padded to it, with a mask
TEMPLATE_TOKENS = 129  # _QWEN_CROP_START: the chat template's tokens before the prompt, cut off the encoder's output
TINY_PROMPT_TOKENS = 128
CLIP_TOKENS = 77
# The released audio VAE's rate and latent hop (MMAudioVAE: sample_rate 44100, hop_length 512, one 2x downsampling): what the
# planner's trace and a batch without cached audio assume; a run's cached audio is sized by its own audio VAE's config.
AUDIO_SAMPLE_RATE = 44_100
AUDIO_LATENT_HOP = 1024


def channels_last(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, F, H, W) -> (B, F, H, W, C), the layout the pipeline denoises."""
    return latents.permute(0, 2, 3, 4, 1)


def channels_first(latents: torch.Tensor) -> torch.Tensor:
    return latents.permute(0, 4, 1, 2, 3)


def audio_latent_count(frames: int, frame_rate: float, sample_rate: int, latent_hop: int) -> int:
    """The audio latents the pipeline draws for a clip of ``frames`` (4k+1) frames: ``ceil(frames / fps * rate / hop)``."""
    return math.ceil(frames / frame_rate * sample_rate / latent_hop)


def padding_mask(condition: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The prompts' boolean padding mask as the pipeline passes it: None where no prompt of the batch is padded."""
    mask = condition.get("prompt_attention_mask")
    if mask is None:
        return None
    mask = mask.bool()
    return None if bool(mask.all()) else mask


class Kandinsky6Call(SoundingCall):
    """The fused video and audio call: ``predict`` gives the video velocity, ``loss`` adds the audio's."""

    def joint_predict(self, model, video: torch.Tensor, audio: torch.Tensor, timesteps: torch.Tensor, condition, context) -> tuple[torch.Tensor, torch.Tensor]:
        """The velocities of video latents (B, C, F, H, W) and audio latents (B, L, C_audio), called as the pipeline's loop calls the transformer."""
        module = getattr(model, "module", model)  # the DeepSpeed engine wraps the transformer
        hidden, visual = self.visual_input(module, channels_last(video).to(context.dtype), condition)
        video_out, audio_out = model(
            hidden_states=hidden, audio_hidden_states=audio.to(context.dtype),
            encoder_hidden_states=condition["prompt_embeds"].to(context.dtype), pooled_projections=condition["pooled_prompt_embeds"].to(context.dtype),
            timestep=timesteps.float(), encoder_attention_mask=padding_mask(condition), return_dict=False, **visual,
        )
        return channels_first(video_out[:, : video.shape[2]]), audio_out  # the clip's frames (image-to-video appends a reference frame)

    def visual_input(self, module, hidden: torch.Tensor, condition) -> tuple[torch.Tensor, dict]:
        """The transformer's video input from channels-last latents, and its other visual arguments (none in text-to-video)."""
        if module.config.visual_cond:
            # [latent | conditioning latent | mask]: nothing given in text-to-video, both zero (the pipeline's loop).
            zeros = torch.zeros_like(hidden)
            hidden = torch.cat([hidden, zeros, zeros[..., :1]], dim=-1)
        return hidden, {}

    def checkpoint_problems(self, folder) -> list[tuple[str, str]]:
        """A pi-Flow distilled checkpoint is refused: its transformer's heads give a policy, not the velocity this entry trains (``policy_head``)."""
        head = policy_head(folder)
        if head is None:
            return []
        return [("model.path", f"{folder.path} is a pi-Flow distilled Kandinsky 6 checkpoint ({head}), which ZeRO-Pipe does not fine-tune: "
                               "pi-Flow trains those heads by imitation distillation, matching the policy's velocity to the non-distilled teacher's "
                               "along the policy's own trajectory (the teacher runs in every step), while flow matching on data drives every grid to "
                               "the same mean and trains the few-step distillation away; no published trainer fine-tunes a pi-Flow student. "
                               "Train the non-distilled release with the same pipeline (kandinskylab/Kandinsky-6.0-Pro-5s-Diffusers or "
                               "Kandinsky-6.0-Lite-5s-Diffusers) as kandinsky6 (docs/video.md, Kandinsky 6)")]

    def audio_length(self, module, video: torch.Tensor) -> int:
        """The audio latents of a clip of these video latents at the codec's frame rate, as the pipeline sizes them."""
        frames = (video.shape[2] - 1) * self.record.codec.frame_multiple + 1
        return audio_latent_count(frames, self.record.codec.frame_rate, AUDIO_SAMPLE_RATE, AUDIO_LATENT_HOP)

    def silent_audio_shape(self, module, video):
        return (video.shape[0], self.audio_length(module, video), module.config.in_audio_dim)

    def trace_inputs(self, config, latent_side, latent_frames, text_tokens, dtype):
        """One clip with its soundtrack (44.1 kHz, a latent per 1024 samples, at 24 fps) and a prompt padded to ``text_tokens``."""
        frames = (latent_frames - 1) * self.record.codec.frame_multiple + 1
        audio = audio_latent_count(frames, self.record.codec.frame_rate, AUDIO_SAMPLE_RATE, AUDIO_LATENT_HOP)
        channels = 2 * config.in_visual_dim + 1 if config.visual_cond else config.in_visual_dim
        return {
            "hidden_states": torch.randn(1, latent_frames, latent_side, latent_side, channels, dtype=dtype),
            "audio_hidden_states": torch.randn(1, audio, config.in_audio_dim, dtype=dtype),
            "encoder_hidden_states": torch.randn(1, text_tokens, config.in_text_dim, dtype=dtype),
            "pooled_projections": torch.randn(1, config.in_text_dim2, dtype=dtype),
            "timestep": torch.tensor([500.0]),
        }


def policy_head(folder) -> str | None:
    """What says a Kandinsky 6 folder is a pi-Flow distilled checkpoint, or None: its transformer's output widened to ``n_grid``
    predictions per latent channel (``out_visual_dim`` = n x ``in_visual_dim``, the audio's too: ``PiflowScheduler._to_grid``
    splits the last axis into them), or a ``PiflowScheduler`` as its scheduler. The sft/pretrain checkpoints' outputs are as wide
    as their inputs and their scheduler is ``FlowMatchEulerDiscreteScheduler``."""
    said = []
    if folder.has_component_config("transformer"):
        config = folder.component_config("transformer")
        for stream in ("visual", "audio"):
            given, out = config.get(f"in_{stream}_dim"), config.get(f"out_{stream}_dim")
            if isinstance(given, int) and isinstance(out, int) and out != given:
                said.append(f"its transformer's out_{stream}_dim {out} is {out / given:g} x in_{stream}_dim {given}")
    if folder.has_scheduler_config():
        scheduler = folder.scheduler_config()
        if scheduler.get("_class_name") == "PiflowScheduler":
            said.append(f"its scheduler is PiflowScheduler with n_grid {scheduler.get('n_grid', 10)}")
    return "; ".join(said) or None


class Kandinsky6I2VCall(Kandinsky6Call):
    """Image-to-video as ``Kandinsky6TI2VAPipeline`` conditions on ``image``: the image's latents (``first_frame_latents``, the
    first frame encoded alone and scaled by the VAE's ``scaling_factor``) appended as a clean tail frame, the mask channel 1 on
    it, token type 1 on it and 0 on the clip, and its rotary position the first frame's (0); the conditioning-latent channels
    stay zero, as in the pipeline's loop. The transformer's output on the tail frame is dropped."""

    def visual_input(self, module, hidden, condition):
        if not module.config.visual_cond or module.config.visual_token_type_num_embeddings < 2:
            from zeropipe.errors import ConfigError

            raise ConfigError([("model.path", "image-to-video needs a Kandinsky 6 transformer with visual_cond true and visual_token_type_num_embeddings >= 2 "
                                              "(its config.json; the released Pro and Lite transformers have both): train this folder as kandinsky6 (text to video)")])
        given = channels_last(condition["first_frame_latents"][:, :, :1]).to(hidden)
        batch, frames, height, width, _ = hidden.shape
        hidden = torch.cat([hidden, given], dim=1)
        zeros = torch.zeros_like(hidden)
        mask = torch.zeros_like(hidden[..., :1])
        mask[:, -1] = 1
        types = torch.zeros(batch, frames + 1, dtype=torch.long, device=hidden.device)
        types[:, -1] = 1
        patch_t, patch_h, patch_w = module.config.patch_size
        device = hidden.device
        rope = (
            torch.cat([torch.arange(frames // patch_t, device=device), torch.zeros(1, dtype=torch.long, device=device)]),
            torch.arange(height // patch_h, device=device), torch.arange(width // patch_w, device=device),
        )
        return torch.cat([hidden, zeros, mask], dim=-1), {"visual_token_type_ids": types, "visual_rope_pos": rope}

    def trace_inputs(self, config, latent_side, latent_frames, text_tokens, dtype):
        """The text-to-video trace with the reference frame appended: one more latent frame, its token type 1."""
        inputs = super().trace_inputs(config, latent_side, latent_frames, text_tokens, dtype)
        hidden = inputs["hidden_states"]
        types = torch.zeros(1, latent_frames + 1, dtype=torch.long)
        types[:, -1] = 1
        return {**inputs, "hidden_states": torch.cat([hidden, hidden[:, :1]], dim=1), "visual_token_type_ids": types}



class Kandinsky6Prompts(PromptEncoding):
    """The pipeline's own ``encode_prompt``: Qwen2.5-VL's tokens after the template, padded with a mask, and CLIP's pooled output."""

    def encode_prompts(self, pipeline, prompts, device):
        # The release's tokenizer is a Qwen2_5_VLProcessor (its tokenizer inside); a tiny preset's, a tokenizer of 129 + 128 tokens.
        tokenizer = getattr(pipeline.tokenizer, "tokenizer", pipeline.tokenizer)
        length = min(self.record.tokenizer_length("tokenizer"), int(tokenizer.model_max_length) - TEMPLATE_TOKENS)
        embeds, pooled, mask, *_ = pipeline.encode_prompt(prompt=list(prompts), do_classifier_free_guidance=False, max_sequence_length=length, device=device)
        if mask is None:  # the pipeline drops a mask without padding
            mask = torch.ones(embeds.shape[:2], dtype=torch.bool, device=embeds.device)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled, "prompt_attention_mask": mask.long()}

    def tiny_tokenizer(self, tokenizer):
        from zeropipe.families.diffusion.tiny.tokenizers import character_tokenizer

        if tokenizer == "tokenizer_2":
            return character_tokenizer(CLIP_TOKENS)
        return template_tokenizer(TEMPLATE_TOKENS + TINY_PROMPT_TOKENS)


def template_tokenizer(max_length: int):
    """A Qwen-style tokenizer for the tiny preset, built without a download, under which the pipeline's chat template before the
    prompt is 129 tokens, as under Qwen2.5's tokenizer: so the pipeline's cut (``_QWEN_CROP_START``) leaves the prompt itself.

    The template's words are single tokens (a word with its leading space one token, as sentencepiece makes them), the chat
    roles with their line break too (``system\\n``, ``user\\n``), the rest characters: 129 tokens before the prompt
    (``tests/unit/diffusion/test_kandinsky6.py`` counts them).
    """
    import re

    import transformers
    from diffusers.pipelines.kandinsky6.pipeline_kandinsky6_ti2va import _PROMPT_TEMPLATE
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from zeropipe.families.diffusion.tiny.tokenizers import CHAT_TOKENS, TOKENIZER_CHARACTERS

    plain = _PROMPT_TEMPLATE
    for token in CHAT_TOKENS:
        plain = plain.replace(token, " ")
    words = sorted({word for word in re.findall(r"[A-Za-z]+", plain) if len(word) > 1})
    characters = sorted(set(TOKENIZER_CHARACTERS) | set(plain.replace("{}", "")) - {" "})
    word_start = "\u2581"
    vocab = [(token, 0.0) for token in (*CHAT_TOKENS, "<unk>")] + [(word_start, -1.0)]
    vocab += [(char, -2.0) for char in characters] + [(word_start + char, -2.5) for char in characters]
    vocab += [(word_start + word, -1.5) for word in words] + [(word, -1.5) for word in words]
    vocab += [("system\n", -1.0), ("user\n", -1.0)]  # the roles with their line break, one token each: 129 before the prompt
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=len(CHAT_TOKENS)))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in CHAT_TOKENS])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="never")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<|endoftext|>", eos_token="<|im_end|>", unk_token="<unk>", model_max_length=max_length,
    )


class Kandinsky6Sampling(Sampling):
    """The pipeline's own call, one prompt per call at its own length (the call takes no padding mask); it returns the audio latents too."""

    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        return {
            "prompt_embeds": condition["prompt_embeds"], "pooled_prompt_embeds": condition["pooled_prompt_embeds"],
            "prompt_attention_mask": condition["prompt_attention_mask"],
            "negative_prompt_embeds": negative["prompt_embeds"], "negative_pooled_prompt_embeds": negative["pooled_prompt_embeds"],
            "negative_prompt_attention_mask": negative["prompt_attention_mask"], "guidance_scale": guidance_scale,
        }

    def sample_outputs(self, pipeline, kwargs):
        """Video latents (B, C, F, H, W) and ``audio_latents`` (B, L, C_audio), in the layout the audio part caches and decodes."""
        from zeropipe.families.diffusion.sampler import pipeline_call

        kwargs = dict(kwargs)
        masks = {"": kwargs.pop("prompt_attention_mask"), "negative_": kwargs.pop("negative_prompt_attention_mask")}
        videos, audios = [], []
        for row in range(kwargs["prompt_embeds"].shape[0]):
            one = dict(kwargs)
            for prefix, mask in masks.items():
                length = int(mask[row].sum())  # the pipeline pads on the right (the tokenizer's side): the prompt is the first `length` rows
                one[f"{prefix}prompt_embeds"] = kwargs[f"{prefix}prompt_embeds"][row : row + 1, :length]
                one[f"{prefix}pooled_prompt_embeds"] = kwargs[f"{prefix}pooled_prompt_embeds"][row : row + 1]
            video, audio = pipeline_call(pipeline, {**one, "output_type": "latent", "return_dict": False})
            videos.append(video)
            audios.append(audio)
        return torch.cat(videos), {"audio_latents": torch.cat(audios).transpose(1, 2)}

    def draw(self, pipeline, kwargs):
        return self.sample_outputs(pipeline, kwargs)[0]


# diffusers' module names -> the native Kandinsky 6 names ComfyUI's model (comfy.ldm.kandinsky6) holds: the table its detection
# applies to a diffusers checkpoint (to_native_state_dict; ComfyUI's test of it spells the pairs out). ComfyUI's LoRA loader maps
# `diffusion_model.<native module>` onto every weight of that model.
NATIVE_NAMES = (
    ("visual_transformer_blocks.", "visual_blocks."), ("audio_out_layer.", "audio_outLayer."),
    (".timestep_embedder.linear_1.", ".in_layer."), (".timestep_embedder.linear_2.", ".out_layer."),
    (".video_dec_block.", ".videoT."), (".audio_dec_block.", ".audioT."),
    (".feed_forward.net.0.proj.", ".feed_forward.in_layer."), (".feed_forward.net.2.", ".feed_forward.out_layer."), (".attn.", ".self_attention."),
)


def native_name(module: str) -> str:
    """A diffusers module name of the transformer as ComfyUI's native Kandinsky 6 model names it."""
    name = f"{module}."
    for diffusers_name, native in NATIVE_NAMES:
        name = name.replace(diffusers_name, native)
    return name[:-1]


class Kandinsky6Layouts(ExportLayouts):
    """The LoRA in ComfyUI's layout: ``diffusion_model.<native module>.lora_A.weight`` / ``lora_B.weight`` / ``.alpha``."""

    def original_lora_layout(self, layers, alpha):
        from zeropipe.families.diffusion.comfy import comfy_lora_layout

        return comfy_lora_layout(layers, alpha, rename=native_name)


# The text-to-video entry (``entries/kandinsky6.py``); ``entries/kandinsky6_i2v.py`` replaces its name, conditions and call.
ATTENTION = r"(to_query|to_key|to_value|out_layer)"
LORA_TARGETS = (
    rf".*(_text_transformer_blocks\.\d+\.attn|visual_transformer_blocks\.\d+\.((video|audio)_dec_block\.(self_attention|cross_attention)|va_cross_attention|av_cross_attention))\.{ATTENTION}"
    r"|.*transformer_blocks\.\d+\.((video|audio)_dec_block\.)?feed_forward\.net\.(0\.proj|2)"
)


def tiny_text_encoder() -> dict:
    """Qwen2.5-VL at 2 layers of 32, its positions long enough for the template (129 tokens) and the padded prompt."""
    qwen = tiny_qwen2_5_vl()
    return {**qwen, "text_config": {**qwen["text_config"], "vocab_size": 256, "max_position_embeddings": 512}}


ARCHITECTURE = Architecture(
    record=Record(
        name="kandinsky6",
        pipeline_class="Kandinsky6TI2VAPipeline",
        denoiser="transformer",
        denoiser_class="Kandinsky6Transformer3DModel",
        objective="flow",
        text_encoders=("text_encoder", "text_encoder_2"),
        tokenizers=("tokenizer", "tokenizer_2"),
        tokenizer_lengths={"tokenizer": PROMPT_TOKENS, "tokenizer_2": CLIP_TOKENS},
        text=PromptText(),
        patch_factor=2,
        codec=SoundingVideoLatents(vae_class="AutoencoderKLHunyuanVideo", frame_multiple=4, frame_rate=24.0),
        conditions=(MMAudioTrack(),),
        lora_targets=LORA_TARGETS,
        preset_name="tiny-kandinsky6",
        preset={
            # Pro's switches (ca_rope, cross_gates, fix_modulation, two visual token types) at 2 fused blocks; the two streams'
            # heads the same width (16), as the cross-modal rotary embedding needs (Pro: 128 each).
            "transformer": {
                "in_visual_dim": 16, "out_visual_dim": 16, "in_text_dim": 32, "in_text_dim2": 32, "time_dim": 32, "patch_size": [1, 2, 2],
                "model_dim": 32, "ff_dim": 64, "num_text_blocks": 1, "num_visual_blocks": 2, "axes_dims": [4, 6, 6], "visual_cond": True,
                "in_audio_dim": 8, "out_audio_dim": 8, "model_dim_a": 16, "time_dim_a": 32, "ff_dim_a": 32, "axes_dims_a": [4, 6, 6],
                "audio_freqs_scaling": 0.144, "text_token_padding": True, "ca_rope": True, "cross_gates": True, "fix_modulation": True,
                "visual_token_type_num_embeddings": 2,
            },
            "vae": tiny_hunyuan_video_vae(),
            "text_encoder": tiny_text_encoder(),
            "text_encoder_2": {"class": "CLIPTextModel", **clip_text(hidden=32)},
            # 16 kHz, 16 mel bins, a 64-sample hop (128 samples a latent; the release: 44.1 kHz, 128 bins, 512), 8 latent channels (40).
            "audio_vae": {
                "class": "MMAudioVAE", "mel_bins": 16, "latent_channels": 8, "hidden_channels": 16, "channel_multipliers": [1, 2], "layers_per_block": 1,
                "sample_rate": 16000, "n_fft": 256, "hop_length": 64, "scaling_factor": 0.5302,
            },
            # Upsamples the mel frames by the hop (4 x 4 x 4 = 64) back to 16 kHz.
            "vocoder": {
                "class": "MMAudioVocoder", "num_mels": 16, "upsample_initial_channel": 32, "upsample_rates": [4, 4, 4], "upsample_kernel_sizes": [8, 8, 8],
                "resblock_kernel_sizes": [3], "resblock_dilation_sizes": [[1, 3, 5]],
            },
            # Euler on flow sigmas with a fixed shift (kandinsky-6's scheduler_scale).
            "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 10.0, "use_dynamic_shifting": False},
        },
        trace_frames=121,  # the pipeline's default length: 5 s at 24 fps
        trace_tokens=PROMPT_TOKENS,  # every prompt is padded to 1024 tokens
    ),
    call=Kandinsky6Call(),
    prompts=Kandinsky6Prompts(),
    sampling=Kandinsky6Sampling(),
    layouts=Kandinsky6Layouts(),
)
