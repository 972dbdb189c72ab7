"""The run config: one typed section per part of a run, with the help text beside each field.

The same descriptions feed the CLI's error messages, the YAML reference in the docs and
(later) the web form, so a field is documented once, here.
"""

from __future__ import annotations

import re

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, StringConstraints, field_validator, model_validator

# The generated text tasks (data.synthetic.task); "shapes" is the image task of diffusion runs.
TEXT_TASKS = ("arithmetic", "reverse", "mixed")

# Issue 46: every size has a bound, checked before any work (a config is anyone's text through the UI:
# `train.max_steps: 1e20` broke the run store, `data.synthetic.examples: 1000000000` filled host memory).
# The largest value of each integer field that counts work or memory, by (section class, field); every
# other integer (seeds, ports...) is bounded by INT_LIMIT, which SQLite, JSON readers and numpy all take.
INT_LIMIT = 2**53
INT_BOUNDS: dict[tuple[str, str], int] = {
    ("TrainSection", "max_steps"): 100_000_000, ("TrainSection", "warmup_steps"): 100_000_000, ("TrainSection", "log_every"): 100_000_000,
    ("TrainSection", "save_every"): 100_000_000, ("TrainSection", "eval_every"): 100_000_000, ("TrainSection", "keep_last"): 10_000,
    ("TrainSection", "micro_batch_size"): 65_536, ("TrainSection", "gradient_accumulation_steps"): 65_536,
    ("SyntheticSection", "examples"): 10_000_000, ("DataSection", "max_seq_len"): 1_048_576, ("DataSection", "mixture_examples"): 100_000_000,
    ("DataSection", "max_bad_records"): 100_000_000, ("ModelSection", "tokenizer_vocab_size"): 1_000_000,
    # 1e6: diffusion-pipe's way of asking peft for full-matrix LoKr (its example), which convert writes as given.
    ("LoraSection", "r"): 1_000_000,
    ("ImagesSection", "resolution"): 8_192, ("ImagesSection", "bucket_step"): 1_024, ("VideoSection", "frame_buckets"): 4_096,
    ("VideoSection", "sample_frames"): 4_096, ("GenerateSection", "max_new_tokens"): 100_000, ("GenerateSection", "sample_every"): 100_000_000,
    ("GenerateSection", "sample_steps"): 1_000, ("HardwareSection", "gpus"): 4_096,
}  # fmt: skip
FLOAT_BOUNDS: dict[tuple[str, str], float] = {("TrainSection", "epochs"): 1_000_000.0}


def bounded(owner: str, name: str, value: Any) -> Any:
    """``value`` when within its field's bound; a ValueError naming the bound (an int, list of ints or float)."""
    limit = INT_BOUNDS.get((owner, name), INT_LIMIT)
    for item in value if isinstance(value, list) else [value]:
        if isinstance(item, int) and not isinstance(item, bool) and not -INT_LIMIT <= item <= limit:
            raise ValueError(f"{item} is more than this field allows (at most {limit:,}): a size this large is refused before any work")
    ceiling = FLOAT_BOUNDS.get((owner, name))
    if ceiling is not None and isinstance(value, float) and value > ceiling:
        raise ValueError(f"{value:g} is more than this field allows (at most {ceiling:g})")
    return value


class Section(BaseModel):
    # Unknown keys are errors: a typo such as `micro_batchsize` must not be silently ignored.
    # .inf and .nan are YAML floats but never a learning rate, a ratio or a scale: refused
    # in every float field, here, rather than failing (or silently training on NaN) later.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _bounded(cls, value: Any, info: Any) -> Any:
        return bounded(cls.__name__, info.field_name, value)


class RunSection(Section):
    name: str | None = Field(None, description="Run name; the run directory is output_dir/name. Defaults to the YAML file's name.")
    output_dir: str = Field("runs", description="Folder that holds run directories (relative paths are relative to the current directory).")
    seed: int = Field(42, description="Seed for model init, data order and dropout; the same seed gives the same run on CPU.")
    accept_warnings: list[Annotated[str, StringConstraints(pattern=r"^ZP\d{3}$")]] = Field(
        default_factory=list,
        description="Warnings (e.g. [ZP012]) this config accepts on purpose: check and train do not repeat them. Errors cannot be accepted.",
    )


class LoraSection(Section):
    kind: Literal["lora", "dora", "lokr", "loha"] = Field(
        "lora",
        description="The adapter (peft builds each): lora; dora (LoRA with a magnitude per output feature, peft's use_dora); "
        "lokr (LyCORIS's Kronecker product, peft's LoKr); loha (LyCORIS's Hadamard product, peft's LoHa). docs/adapters.md says which "
        "exports ComfyUI and diffusers load for each.",
    )
    r: int = Field(8, ge=1, description="Adapter rank (LoKr: the rank its large factor is decomposed to).")
    alpha: float = Field(16, gt=0, description="Adapter alpha (scaling = alpha / r).")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the adapter's input (lora and dora; peft's LoKr and LoHa have none).")
    factor: int = Field(-1, description="LoKr only: the Kronecker factor each dimension is split by (peft's decompose_factor, LyCORIS's factor); -1: the most balanced split.")
    target_modules: list[str] | str = Field(
        "auto",
        description="Module names to adapt (e.g. [q_proj, v_proj]), 'all-linear', 'auto': the attention projections of the family "
        "(q_proj, k_proj, v_proj, o_proj for language models; to_q, to_k, to_v, to_out.0 for diffusion models), or one string that is a "
        "regular expression matched against whole module names, as peft reads it (e.g. 'model.language_model.layers.[\\d]+.self_attn.[qkvo]_proj': the language model's attention only, as axolotl's vision recipes write it).",
    )

    init_from: str | None = Field(
        None,
        description="Continue from an existing adapter: a LoRA file or folder (peft's adapter_model.safetensors, diffusers' "
        "pytorch_lora_weights.safetensors, ComfyUI's, kohya's, musubi-tuner's or ai-toolkit's layouts, ZeRO-Pipe's own exports). "
        "Its rank and modules must be the run's (r, target_modules); its alpha is converted exactly. docs/adapters.md.",
    )

    # Mixture-of-experts models (docs/moe.md).
    target_parameters: list[str] | Literal["experts"] | None = Field(
        None,
        description="Mixture-of-experts models: LoRA on the experts' weights too (peft's target_parameters, kind lora only, dropout 0). "
        "'experts': every experts module's 3-D projections (e.g. mlp.experts.gate_up_proj and down_proj), found from the model; or the "
        "parameter names, e.g. [mlp.experts.gate_up_proj].",
    )

    @model_validator(mode="before")
    @classmethod
    def _experts_take_plain_lora(cls, data: Any) -> Any:
        # peft's ParamWrapper (LoRA on a parameter) refuses dropout and every LoRA variant.
        if not isinstance(data, dict) or data.get("target_parameters") is None:
            return data
        if data.get("kind", "lora") != "lora":
            raise ValueError(f"target_parameters: peft adapts the experts' weights with plain LoRA only, and model.lora.kind is {data['kind']}: set kind: lora or remove target_parameters")
        if data.get("dropout") not in (None, 0, 0.0):
            raise ValueError("dropout: peft's LoRA on the experts' weights (target_parameters) takes no dropout: set model.lora.dropout: 0 or remove target_parameters")
        return {**data, "dropout": 0.0}  # LoRA's default 0.05 does not apply: written as what runs

    @model_validator(mode="before")
    @classmethod
    def _options_of_the_kind(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        kind = data.get("kind", "lora")
        if kind in ("lokr", "loha"):
            dropout = data.get("dropout")
            if dropout not in (None, 0, 0.0):
                raise ValueError(f"dropout: peft's {'LoKr' if kind == 'lokr' else 'LoHa'} has no dropout on its input: remove model.lora.dropout (or set it to 0)")
            data = {**data, "dropout": 0.0}  # LoRA's default 0.05 does not apply: written as what runs
        if kind != "lokr" and data.get("factor", -1) != -1:
            raise ValueError(f"factor: is LoKr's Kronecker factor, and this adapter is {kind}: remove model.lora.factor or set kind: lokr")
        return data

    @field_validator("target_modules")
    @classmethod
    def _a_pattern_compiles(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, str) and value not in ("auto", "all-linear"):
            try:
                re.compile(value)
            except re.error as err:
                raise ValueError(f"{value!r} is neither auto, all-linear, a list of module names nor a regular expression ({err})") from None
        return value


QUANTIZATION_FORMATS = ("nf4", "fp4", "int8", "fp8", "fp8_e5m2")


class QuantizationSection(Section):
    """How the frozen base is stored for LoRA: 8-bit float (fp8, fp8_e5m2; ZeRO-0..3, CPU and GPU), or bitsandbytes' 4-bit (QLoRA: nf4, fp4) or int8.

    Written as one word (``model.quantization: fp8``) or as a section. fp8 stores the linear layers of the
    repeated blocks as fp8 bytes with a float32 scale per output channel (or per tensor), computed in the
    training precision; under ZeRO-3 those bytes are what is partitioned, gathered and offloaded.
    """

    format: Literal["auto", "nf4", "fp4", "int8", "fp8", "fp8_e5m2"] = Field(
        "auto",
        description="Storage of the base weights: fp8 (e4m3, the usual one) or fp8_e5m2, for causal LMs, vision-language models (the language "
        "model's blocks) and diffusion transformers, on CPU ranks and GPUs, under any ZeRO stage; nf4/fp4 (QLoRA, bitsandbytes) or int8 "
        "(bitsandbytes' LLM.int8, ZeRO-0..2) for causal LMs, and for diffusion denoisers under ZeRO-0..2. "
        "'auto': quant_type (4-bit QLoRA, as before).",
    )
    scale: Literal["channel", "tensor"] = Field(
        "channel", description="fp8: one float32 scale per output channel (closer to the bf16 weights) or one per tensor (ComfyUI's fp8_scaled). "
        "A pre-quantized file keeps its own: ComfyUI's per-tensor or per-channel scale_weight, transformers' fine-grained FP8 block scales (weight_scale_inv)."
    )
    load_in_4bit: bool = Field(True, description="QLoRA: load the base weights in 4-bit.")
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type; nf4 is what QLoRA uses.")
    double_quant: bool = Field(True, description="Quantize the quantization constants too (saves about 0.4 bits per parameter).")
    compute_dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field("auto", description="Dtype of the matmuls; 'auto' follows deepspeed.precision.")
    quant_storage: Literal["auto", "bf16", "fp16", "fp32", "uint8"] = Field(
        "auto", description="Storage dtype of the packed weights; under ZeRO-3 it must be the model's dtype, deepspeed.precision ('auto' does that; below ZeRO-3 'auto' is uint8)."
    )

    @property
    def storage(self) -> str:
        """The format the base is stored in: fp8, fp8_e5m2, int8, nf4 or fp4."""
        return self.quant_type if self.format == "auto" else self.format

    @property
    def is_fp8(self) -> bool:
        return self.storage in ("fp8", "fp8_e5m2")


class DiffusionSection(Section):
    """The training objective of a diffusion model."""

    prediction_type: Literal["auto", "epsilon", "v_prediction", "flow"] = Field(
        "auto",
        description="What the network predicts: noise (epsilon), velocity (v_prediction) or the flow-matching velocity (flow). "
        "'auto': the scheduler's setting for UNets, flow for SD3/Flux transformers.",
    )
    min_snr_gamma: float | None = Field(None, gt=0, description="Min-SNR loss weighting (Hang et al. 2023), typically 5; UNet family only.")
    noise_offset: float = Field(0.0, ge=0, description="Noise offset (e.g. 0.05): lets the model learn very dark and very bright images; UNet family only.")
    timestep_sampling: Literal["auto", "uniform", "logit_normal"] = Field(
        "auto", description="How training timesteps are drawn; 'auto': uniform for UNets, logit-normal for flow matching (SD3 paper)."
    )
    logit_mean: float = Field(0.0, description="Mean of the logit-normal timestep distribution.")
    logit_std: float = Field(1.0, gt=0, description="Standard deviation of the logit-normal timestep distribution.")
    shift: float | Literal["auto"] = Field(
        "auto", description="Timestep shift of flow matching (SD3 uses 3.0); 'auto': the scheduler config's shift, else 1.0 (no shift)."
    )
    guidance: float = Field(1.0, ge=0, description="Guidance value fed to guidance-distilled transformers (Flux dev: 1.0 for training); ignored otherwise.")
    guidance_preserving: float | None = Field(
        None,
        gt=0,
        description="Guidance-distilled models whose entry selects it (docs/diffusion.md; none of the built-in entries yet): train with the guidance-preserving objective, reading the model's output as guided at this "
        "classifier-free guidance scale (e.g. 4) and fitting the raw velocity recovered with its own unconditional prediction, so LoRA training keeps the "
        "built-in guidance (diffusion-pipe's CFG-augmented training, its `cfg`). One more forward pass per step, without gradient. None: plain flow matching.",
    )
    min_t: float = Field(
        0.0, ge=0, le=1, description="Flow matching: train only on noise levels t >= min_t (t in [0, 1] after the shift, 1 is pure noise). "
        "Wan 2.2 A14B's high-noise expert: min_t 0.875 (T2V; 0.9 for I2V)."
    )
    max_t: float = Field(
        1.0, ge=0, le=1, description="Flow matching: train only on noise levels t <= max_t. Wan 2.2 A14B's low-noise expert: max_t 0.875 (T2V; 0.9 for I2V)."
    )
    expert: Literal["high_noise", "low_noise"] | None = Field(
        None,
        description="Wan 2.2 A14B (a pipeline with transformer/ and transformer_2/ and a boundary_ratio): the expert to train. "
        "high_noise trains transformer/ on t >= the boundary (0.875 T2V, 0.9 I2V), low_noise trains transformer_2/ on t <= it; "
        "min_t/max_t left at 0/1 are set to that side, and the export writes the expert's own folder.",
    )
    task: Literal["auto", "image-to-video"] = Field("auto", description="Kandinsky 6, MiniMax-H3 (one checkpoint draws from a prompt, or a prompt and an image): image-to-video trains its image-to-video entry, each clip's first frame the reference; 'auto': the folder's own (text-to-video). A model whose image-to-video checkpoint is its own folder (Wan 2.1 I2V) needs none.")  # fmt: skip
    denoiser_file: str | None = Field(
        None,
        description="A single-file checkpoint (.safetensors) of the transformer or UNet in its original or ComfyUI layout (e.g. wan2.1_t2v_14B_bf16.safetensors), "
        "loaded instead of the pipeline directory's own weights (model.path still gives its config, VAE and text encoders); names converted with diffusers' converter.",
    )


class ModelSection(Section):
    family: str = Field(
        "auto",
        pattern=r"^[a-z][a-z0-9_]*$",
        description="Model family: auto, causal_lm, vlm, diffusion, or one a plug-in registers (ZEROPIPE_PLUGINS). 'auto' reads it from "
        "model.path (model_index.json: diffusion; a vision config: vlm) or model.config (a 'pipeline' key: diffusion), else causal_lm.",
        json_schema_extra={"examples": ["auto", "causal_lm", "vlm", "diffusion"]},
    )
    path: str | None = Field(
        None,
        description="Local model directory: a Hugging Face model (config.json + safetensors) or a diffusers pipeline (model_index.json). Exclusive with model.config.",
    )
    config: dict[str, Any] | None = Field(
        None,
        description="Inline config for a randomly initialised model: a transformers config, e.g. {model_type: llama, hidden_size: 64, ...}, "
        "or a diffusion pipeline, e.g. {pipeline: tiny-sdxl} with optional per-component overrides {unet: {...}, vae: {...}}. Exclusive with model.path.",
    )
    diffusion: DiffusionSection = Field(default_factory=DiffusionSection, description="Objective of diffusion models (ignored by other families).")
    tokenizer: str | None = Field(
        None,
        description="Tokenizer directory. Defaults to model.path; with model.config and no tokenizer, one is trained on the data.",
    )
    processor: str | None = Field(
        None,
        description="Vision-language models: directory of a saved processor (tokenizer + image processor). Defaults to model.path; "
        "with model.config and no processor, one is built (LLaVA, Gemma 3) with a tokenizer trained on the data.",
    )
    trainable: list[Literal["vision_tower", "projector", "language_model"]] | None = Field(
        None,
        description="Vision-language models: the parts that train (vision_tower, projector, language_model); the others are frozen and "
        "get no optimizer state. With model.lora the adapters go on these parts only. Default: [projector, language_model].",
    )
    tokenizer_vocab_size: int = Field(
        300,
        ge=262,
        description="Vocabulary size of the byte-level BPE tokenizer trained on the data when the model has none (at least 256 bytes + 6 special tokens).",
    )
    gradient_checkpointing: bool | Literal["auto"] = Field(
        False, description="Recompute activations in the backward pass: less memory, about 30% more compute. 'auto': the planner decides."
    )
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa", description="Attention kernel passed to transformers.")
    lora: LoraSection | None = Field(None, description="Train LoRA adapters (peft) instead of all weights; only adapter weights are trainable.")
    quantization: QuantizationSection | None = Field(
        None,
        description="Store the frozen base quantized for LoRA (needs model.lora): fp8 or fp8_e5m2 (any family's transformer blocks, any ZeRO stage, "
        "CPU ranks too; fp8 checkpoints such as Qwen3-*-FP8 or ComfyUI's fp8_scaled are read as stored), nf4/fp4 (QLoRA) or int8 with bitsandbytes "
        "(causal LMs; diffusion denoisers under ZeRO-0..2; on CPU ranks bitsandbytes >= 0.47). One word (fp8) or a section.",
    )

    @field_validator("quantization", mode="before")
    @classmethod
    def _one_word_is_a_format(cls, value: Any) -> Any:
        if isinstance(value, str):
            if value not in QUANTIZATION_FORMATS:
                raise ValueError(f"{value!r} is not a storage format: one of {', '.join(QUANTIZATION_FORMATS)}, or a section")
            return {"format": value}
        return value
    load_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments for from_pretrained (e.g. {revision: main, trust_remote_code: true})."
    )
    # Mixture-of-experts models (docs/moe.md).
    router_aux_loss_coef: float | None = Field(
        None,
        ge=0,
        description="Mixture-of-experts models: weight of the router's load-balancing loss added to the LM loss (the model's own "
        "output_router_logits and router_aux_loss_coef). Default: the model config's coefficient (0.001 in Qwen3-MoE's published config, 0.02 in Mixtral's); 0 turns it off.",
    )
    experts_implementation: Literal["auto", "grouped_mm", "batched_mm", "eager"] = Field(
        "auto",
        description="Mixture-of-experts models: how transformers computes the experts. auto: grouped_mm (one grouped matmul for all experts) "
        "where torch has it, else eager (a loop over the experts hit); batched_mm gathers each token's experts' weights.",
    )
    zero3_leaf_blocks: bool = Field(
        True,
        description="Mixture-of-experts models under ZeRO-3: gather each MoE block (router and all its experts) at once, as one DeepSpeed leaf module. "
        "Off only to measure the difference (benchmarks/moe_speed.py): experts kept as separate modules are then fetched in each rank's routing order, which can hang.",
    )


class SyntheticSection(Section):
    task: Literal["arithmetic", "reverse", "mixed", "shapes"] = Field(
        "mixed",
        description="Generated task the model can visibly learn: instructions (arithmetic, reverse, mixed) or captioned images of "
        "coloured shapes (shapes: diffusion and vision-language models; for video models, mp4 clips of moving shapes with a few stills).",
    )
    examples: int = Field(4000, ge=10, description="Number of generated examples.")
    seed: int = Field(0, description="Seed of the generator.")


class ImagesSection(Section):
    """How images become training examples (diffusion)."""

    resolution: int = Field(1024, ge=8, description="Target side length: each bucket holds about resolution x resolution pixels.")
    bucketing: bool = Field(True, description="Aspect-ratio buckets around the resolution (images keep their shape); off: every image is cropped square.")
    bucket_step: int = Field(64, ge=8, description="Bucket sides are multiples of this (64 for SD/SDXL/Flux at full size; 8 works for tiny models).")
    max_aspect: float = Field(2.0, ge=1, description="Most elongated bucket (width/height or height/width).")
    crop: Literal["center", "random"] = Field("center", description="Crop to the bucket from the centre or at random (random needs cache.latents off).")
    flip: float = Field(0.0, ge=0, le=1, description="Probability of a horizontal flip (with cached latents, both orientations are cached).")
    caption_dropout: float = Field(0.0, ge=0, le=1, description="Probability of training on the empty caption, which classifier-free guidance needs (0.05-0.1 usual).")
    caption_ext: str = Field(
        ".txt", pattern=r"^\.[A-Za-z0-9_-]{1,16}$", description="Extension of the caption files beside the images (kohya layout)."
    )


class CacheSection(Section):
    """Latent and text-embedding caches (diffusion)."""

    latents: bool = Field(True, description="Encode every image with the VAE once and train on the stored latents.")
    text: bool = Field(True, description="Encode every caption with the text encoders once and train on the stored embeddings.")
    dir: str | None = Field(
        None,
        description="Cache folder shared by runs (diffusion latents and text embeddings; causal LMs' token caches under tokens/); entries are keyed "
        "by a fingerprint of what they depend on. Default: OUTPUT_DIR/.zeropipe-cache.",
    )


class VideoSection(Section):
    """How videos become training clips (video diffusion models such as Wan)."""

    frame_buckets: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: [1, 33],
        description="Clip lengths in frames; each must be one the VAE accepts (4k+1 for Wan: 1, 17, 33, 49, 65, 81). A video trains as clips of the "
        "longest bucket it fills; 1 lets images train as one-frame clips.",
    )
    clip_mode: Literal["start", "middle", "multiple"] = Field(
        "start", description="Which clips of a longer video train: start (one from the first frame), middle (one centred) or multiple (as many as fit, spread evenly)."
    )
    fps: float | Literal["auto"] = Field("auto", description="Frame rate clips are taken at; 'auto': the model's (16 for Wan).")
    sample_frames: int | None = Field(None, ge=1, description="Length of the sample videos drawn during training; default: the longest frame bucket.")


class VisionDataSection(Section):
    """Image-text data of vision-language models."""

    image_root: str | None = Field(
        None,
        description="Folder that relative image paths in the data file are relative to. Default: the data file's folder "
        "(or its Images/ subfolder, the Kaggle Flickr8k layout).",
    )
    caption_prompt: str = Field(
        "Describe the image.", description="User turn paired with each image of caption data (captions are the answers the model learns)."
    )


class MixtureSource(Section):
    """One dataset of data.mixture: a file (or folder) or a generated task, and its share."""

    path: str | None = Field(
        None, description="A .jsonl/.json/.txt/.parquet/.csv/.tsv/.arrow file, a folder of them or a datasets.save_to_disk folder. Exclusive with synthetic."
    )
    synthetic: SyntheticSection | None = Field(None, description="A generated dataset instead of a file. Exclusive with path.")
    format: Literal["auto", "alpaca", "dolly", "chat", "sharegpt", "text"] = Field("auto", description="Record format of this source (as data.format).")
    columns: dict[str, str] | None = Field(None, description="This source's column for each name ZeRO-Pipe reads (as data.columns).")
    weight: float = Field(1.0, gt=0, description="Share of the mixture, relative to the other sources' weights (0.7 and 0.3, or 7 and 3).")


class DataSection(Section):
    path: str | None = Field(
        None,
        description="Training data: a .jsonl/.json/.txt/.parquet/.csv/.tsv/.arrow file, a folder of shards of them (the Hub's data/*.parquet) "
        "or a folder written by datasets' save_to_disk (its train split); for diffusion, an image folder (kohya layout or metadata.jsonl); "
        "for vision-language models, a captions file (Flickr8k image.jpg#0<TAB>caption, CSV image,caption, JSONL {image, caption} or "
        "{messages, images}) or an image folder. Exclusive with data.synthetic.",
    )
    format: Literal["auto", "alpaca", "dolly", "chat", "sharegpt", "text"] = Field(
        "auto", description="Record format; 'auto' detects alpaca, dolly, chat (messages), sharegpt (conversations) or text."
    )
    columns: dict[str, str] | None = Field(
        None,
        description="Your data's column (or key) for each name ZeRO-Pipe reads, e.g. {instruction: question, output: answer} or "
        "{messages: dialog}: the names are instruction/input/output (alpaca), instruction/context/response (dolly), messages (chat), "
        "conversations (sharegpt) and text, as LLaMA-Factory's dataset_info.json columns and axolotl's field keys map them.",
    )
    num_workers: PositiveInt | Literal["auto"] = Field(
        "auto",
        description="Processes that render and tokenize the records side by side before the ranks start (causal LMs); 'auto': one per core "
        "of the launcher (the ranks start after it), at most 8. The token cache is the same whatever the number.",
    )
    max_seq_len: int = Field(512, ge=8, description="Longest tokenized example; longer instruction examples are truncated, long texts are split.")
    max_bad_fraction: float = Field(
        0.01, ge=0, le=1, description="The run refuses to start when more than this fraction of records are malformed."
    )
    max_bad_records: int | None = Field(None, ge=0, description="A count of malformed records tolerated, used instead of max_bad_fraction when set.")
    synthetic: SyntheticSection | None = Field(None, description="Generate a small dataset into the run directory instead of reading data.path.")
    packing: bool = Field(
        False,
        description="Causal LMs: pack several examples into each sequence of max_seq_len tokens, so batches are nearly all real tokens "
        "instead of padding. Position ids restart at 0 for every example, so attention and loss stay within each example; "
        "train.micro_batch_size then counts packed sequences. Which examples share a sequence is decided once, before training. "
        "Works with models whose transformers code builds its mask with transformers' masking utilities (Llama, Qwen, Mistral, Gemma, Phi-3 "
        "and most current families), with sdpa or eager attention.",
    )
    group_by_length: bool = Field(
        False,
        description="Put examples of similar length in the same micro-batch (the order of batches is still shuffled): "
        "less padding without packing. Exclusive with data.packing.",
    )
    eval_path: str | None = Field(
        None, description="Held-out data for evaluation, in the same formats as data.path. Exclusive with data.eval_fraction."
    )
    eval_fraction: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Hold out this fraction of the training records for evaluation, e.g. 0.05; the records are drawn with run.seed, "
        "so every run with the same data and seed holds out the same ones. Exclusive with data.eval_path.",
    )
    control_path: str | None = Field(
        None,
        description="Edit training (Qwen-Image-Edit): a folder with a control image per target image of data.path, found by the same "
        "file name (stem; any image type), at the same relative path or at the folder's top. The model learns to turn the control "
        "image into the target as the caption says. As diffusion-pipe's [[directory]] control_path. Multi-reference edit training "
        "(Qwen-Image-Edit-Plus, FLUX.2 with reference images) reads several per target from this one folder as musubi-tuner's "
        "control_directory does: NAME.* (if any), then NAME_0.*, NAME_1.*, ... in that order.",
    )
    control_paths: list[str] | None = Field(
        None,
        description="Multi-reference edit training (Qwen-Image-Edit-Plus, FLUX.2 with reference images): one folder per reference "
        "image, each with an image per target of data.path found by its file name as in data.control_path; the first folder gives "
        "the first reference ('Picture 1'). As diffusion-pipe's [[directory]] control_paths. Exclusive with data.control_path.",
    )
    images: ImagesSection = Field(default_factory=ImagesSection, description="Bucketing, cropping, flips and caption dropout (diffusion).")
    cache: CacheSection = Field(default_factory=CacheSection, description="Latent and text-embedding caches (diffusion).")
    video: VideoSection = Field(default_factory=VideoSection, description="Frame buckets, clips and frame rate (video diffusion models).")
    vision: VisionDataSection = Field(default_factory=VisionDataSection, description="Image paths and caption prompt (vision-language models).")
    mixture: list[MixtureSource] | None = Field(
        None,
        description="Causal LMs: train on several datasets mixed by weight, e.g. [{path: a.jsonl, weight: 0.7}, {synthetic: {task: arithmetic}, weight: 0.3}]. "
        "The mixture is drawn once, before training, with run.seed: each source gives weight / total weight of data.mixture_examples "
        "examples, repeating a small source and sampling a large one. Sources may differ in format but must all be conversations "
        "(instructions, chat) or all plain text. Exclusive with data.path and data.synthetic.",
    )
    mixture_examples: int | None = Field(
        None, ge=1, description="Size of the drawn mixture; default: as many examples as all sources hold together."
    )


class EmaSection(Section):
    """An exponential moving average of the trained weights, kept by each rank for its own ZeRO partition (docs/ema.md)."""

    decay: float = Field(0.999, gt=0, lt=1, description="Decay of the average: ema = decay * ema + (1 - decay) * weights (0.999-0.9999 usual).")
    every: int = Field(1, ge=1, description="Update the average every N optimizer steps.")
    warmup: Literal["ratio", "power", "none"] = Field(
        "ratio",
        description="How the decay ramps up over the first updates (diffusers' EMAModel.get_decay): 'ratio': min(decay, (1+n)/(10+n)); "
        "'power': min(decay, 1-(1+n)^-power); 'none': decay from the second update on. n counts updates from 0; the first update copies the weights.",
    )
    power: float = Field(2 / 3, gt=0, description="Exponent of warmup: power (diffusers' default 2/3; 3/4 for short runs).")
    sample_from_ema: bool = Field(
        False,
        description="Draw the samples during training (generate.sample_every, the UI's Sample now, the end's; a language model's answers too) "
        "with the EMA weights instead of the trained ones, as ai-toolkit and SimpleTuner offer; the trained weights are back for the next step.",
    )


class TrainSection(Section):
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps to run; overrides train.epochs when both are set.")
    epochs: float | None = Field(None, gt=0, description="Passes over the data (default 1 when max_steps is not set).")
    micro_batch_size: PositiveInt | Literal["auto"] = Field(1, description="Examples per rank per forward pass; 'auto': the planner decides.")
    gradient_accumulation_steps: PositiveInt | Literal["auto"] = Field(
        1, description="Micro-batches accumulated per optimizer step; 'auto': the planner decides."
    )
    lr: float = Field(2e-5, gt=0, description="Peak learning rate (after warm-up).")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warm-up: cosine or linear to min_lr_ratio x lr, or constant.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps from 0 to lr.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final learning rate as a fraction of lr (cosine and linear schedules).")
    optimizer: Literal["adamw", "muon", "adafactor", "adamw8bit", "prodigy"] = Field(
        "adamw",
        description="The optimizer: adamw (DeepSpeed's AdamW, any ZeRO stage and offload); muon (DeepSpeed's Muon for the weight "
        "matrices with an auxiliary AdamW for the rest, ZeRO 0-3 without offload); adafactor (torch.optim.Adafactor, ZeRO-0: it "
        "factors whole matrices, which ZeRO 1-3's flat partitions are not); adamw8bit (bitsandbytes' AdamW8bit, 8-bit moments, "
        "ZeRO 0-3 without offload); prodigy (the prodigyopt package, learning-rate free: set train.lr 1.0; ZeRO-0). docs/optimizers.md",
    )
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="Muon's momentum (train.optimizer: muon).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient norm to this value (0 disables clipping).")
    log_every: int = Field(
        1,
        ge=1,
        description="Write a line to rank 0's log every N steps; metrics.jsonl gets a row for every step, written every N steps (and at each checkpoint): the steps between read nothing back from the GPU.",
    )
    save_every: int | None = Field(None, ge=1, description="Save a checkpoint every N optimizer steps (a final one is always saved).")
    eval_every: int | None = Field(
        None,
        ge=1,
        description="Evaluate on the held-out data (data.eval_path or data.eval_fraction) every N optimizer steps; with held-out data, "
        "the end of training is always evaluated. Eval loss and perplexity (a diffusion run: the validation loss at fixed timesteps and noise, "
        "docs/diffusion.md) are written to metrics.jsonl.",
    )
    keep_last: int = Field(2, ge=1, description="Keep this many most recent checkpoints; older ones are deleted after a newer one is complete.")
    activation_offload: bool = Field(
        False,
        description="With model.gradient_checkpointing: keep each checkpointed block's inputs in host memory (pinned on GPU ranks) instead of "
        "on the GPU, and bring them back for the block's recomputation in backward. Frees layers x tokens x hidden x 2 bytes of GPU memory per "
        "micro-batch (what dominates long sequences and video) for the same amount of host RAM per rank and a copy each way over the host "
        "link; the losses are the same as without. Needs model.gradient_checkpointing: true.",
    )
    ema: EmaSection | None = Field(
        None, description="Keep an exponential moving average of the trained weights, saved in every checkpoint; absent: none (docs/ema.md)."
    )


class GenerateSection(Section):
    prompts: list[str] | None = Field(
        None,
        description="Prompts answered (language models) or drawn (diffusion models) by the trained model at the end of the run "
        "(and every generate.sample_every steps). Unset: a few prompts from the data; [] to generate nothing.",
    )
    images: list[str] = Field(
        default_factory=list,
        description="Vision-language models: images the prompts are asked about, one per prompt (or one prompt for all images; with no "
        "prompts, data.vision.caption_prompt). Default: a few held-out synthetic shape images.",
    )
    max_new_tokens: int = Field(32, ge=1, description="Tokens generated per prompt.")
    sample_every: int | None = Field(None, ge=1, description="Diffusion: also draw the prompts every N steps, into RUN/samples/ (shown in the UI).")
    sample_steps: int = Field(20, ge=1, description="Diffusion: denoising steps per sample image.")
    guidance_scale: float = Field(5.0, ge=0, description="Diffusion: classifier-free guidance scale of the sample images (1 disables it).")
    sample_seed: int = Field(0, description="Diffusion: seed of the sample images' starting noise (the same for every step, so samples are comparable).")


class LoggingSection(Section):
    tensorboard: bool = Field(True, description="Write TensorBoard event files under the run directory (tensorboard --logdir RUN_DIR).")
    wandb: bool = Field(False, description="Log to Weights & Biases (needs the wandb package; WANDB_MODE=offline works without a network).")
    wandb_project: str = Field("zeropipe", description="Weights & Biases project name.")
    mlflow: bool = Field(False, description="Log to MLflow (needs the mlflow package; MLFLOW_TRACKING_URI, else MLflow's own local default).")


class DeepSpeedSection(Section):
    zero_stage: Literal[0, 1, 2, 3, "auto"] = Field(
        2,
        description="ZeRO stage: 0 data parallel, 1 shards optimizer states, 2 also gradients, 3 also parameters; 'auto': the fastest that fits (zeropipe plan).",
    )
    offload_optimizer: Literal["none", "cpu", "auto"] = Field(
        "none", description="Keep optimizer states in host RAM and step with DeepSpeed's CPU Adam (stage 1-3); 'auto': the planner decides "
        "(never on CPU ranks, whose memory is host RAM already)."
    )
    offload_param: Literal["none", "cpu", "auto"] = Field(
        "none", description="Keep parameters in host RAM between uses (stage 3 only); 'auto': the planner decides (never on CPU ranks)."
    )
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto",
        description="Training precision; bf16 and fp16 keep fp32 master weights in the optimizer. 'auto': bf16 on GPUs that have it "
        "(else fp16), and on CPU ranks bf16 only where the CPU runs it natively (avx512_bf16/AMX), else fp32.",
    )
    config_file: str | None = Field(
        None,
        description="Your own DeepSpeed JSON (e.g. written for HF Trainer or axolotl); its \"auto\" values are filled in from this config.",
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="Raw keys merged last into the generated DeepSpeed JSON (advanced; e.g. {zero_optimization: {reduce_bucket_size: 5e7}})."
    )


class ParallelSection(Section):
    sequence_parallel_size: int = Field(
        1,
        ge=1,
        description="Ulysses sequence parallelism (causal LMs): groups of this many ranks share one sample's tokens, each holding "
        "1/N of them and 1/N of the attention heads; data parallelism is ranks / N. Also read from a DeepSpeed JSON's "
        "sequence_parallel_size. docs/parallel.md.",
    )
    tiled_loss: bool | Literal["auto"] = Field(
        "auto",
        description="Causal LMs: compute the LM head and cross-entropy loss_tile_tokens tokens at a time, recomputed in backward, so the "
        "logits of the whole (local) sequence never exist: what lets one sample of 100k+ tokens train. 'auto': on when one rank's "
        "micro-batch logits (tokens x vocabulary, fp32) would exceed 1 GiB; the run log says what was chosen. Works with and without "
        "sequence parallelism and with packing. Not for models that post-process their logits (soft-capping, logit scale) or a "
        "mixture of experts (router loss): auto leaves those off, true refuses. docs/parallel.md.",
    )
    loss_tile_tokens: int = Field(1024, ge=16, description="Tokens per tile of the tiled loss (parallel.tiled_loss): the peak holds tile x vocabulary logits (1024 x a 128k vocabulary: about 1.8 GB in bf16 with the fp32 copies).")


class HardwareSection(Section):
    gpus: int | Literal["auto"] = Field("auto", description="Ranks to start: one per GPU; 'auto' uses every visible GPU, or 2 CPU ranks without CUDA.")
    accelerator: Literal["auto", "cuda", "cpu"] = Field("auto", description="'auto' uses CUDA when available, else CPU ranks (gloo).")
    master_port: int | None = Field(None, ge=1024, le=65535, description="TCP port of the rendezvous; a free one is picked when unset.")
    nodes: list[str] | None = Field(
        None,
        description="Several machines: their host names, the first one hosting rank 0 (e.g. [box1, box2]); each runs hardware.gpus "
        "ranks. localhost, 127.0.0.1 and this machine's name start here, the others over SSH. run.output_dir must be shared by all "
        "(see docs/multinode.md). Unset: this machine only, or the nodes of the SLURM allocation the command runs in.",
    )
    hostfile: str | None = Field(
        None, description="A DeepSpeed hostfile instead of hardware.nodes: one 'HOST slots=N' line per machine (N ranks there)."
    )
    master_addr: str | None = Field(
        None, description="Address every node reaches the first node at for the rendezvous; unset: the first node's name."
    )
    launcher: Literal["auto", "ssh", "slurm"] = Field(
        "auto", description="How other nodes are started: 'ssh' (OpenSSH), 'slurm' (srun inside an allocation); 'auto': srun inside SLURM, else SSH."
    )
    ssh_port: int | None = Field(None, ge=1, le=65535, description="SSH port of the other nodes (unset: ssh's own default or ~/.ssh/config).")
    ssh_options: str = Field("", description="Extra ssh arguments for the other nodes, e.g. '-i ~/.ssh/cluster_key -l trainer'.")


class StageSection(Section):
    """One stage of a curriculum: the top-level config with this stage's sections merged over it.

    Each stage trains the weights the stage before it ended with, with a fresh DeepSpeed
    engine (optimizer, schedule and ZeRO settings of its own), in its own sub-run directory
    RUN/stages/NN-name/ (checkpoints, metrics, logs, and the exported weights the next stage
    starts from).
    """

    name: str = Field(
        ...,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Stage name (letters, digits, '-', '_', '.'): labels its metrics rows and names its directory RUN/stages/NN-name.",
    )
    model: dict[str, Any] = Field(
        default_factory=dict,
        description="What trains in this stage, over model: e.g. {lora: {r: 16}} for LoRA, {lora: null} for all weights, "
        "{trainable: [projector]} for a vision-language model, gradient_checkpointing. The model itself (path, config, family, "
        "tokenizer) is set once at the top level: a stage starts from the previous stage's weights (a LoRA stage's adapter is "
        "merged into them first; a LoRA stage after a full one gets fresh adapters).",
    )
    data: dict[str, Any] = Field(
        default_factory=dict,
        description="This stage's data, over data: (e.g. {mixture: [...]} or {path: sft.jsonl}, max_seq_len). Naming a source "
        "(path, synthetic or mixture) replaces the top level's source instead of adding to it.",
    )
    train: dict[str, Any] = Field(
        default_factory=dict, description="This stage's length and schedule, over train: e.g. {max_steps: 200, lr: 1e-4, schedule: cosine, warmup_steps: 20} or {epochs: 1}."
    )
    deepspeed: dict[str, Any] = Field(
        default_factory=dict, description="This stage's ZeRO settings, over deepspeed: e.g. {zero_stage: 3, offload_optimizer: cpu}."
    )


PAIRED_METHODS = ("dpo", "orpo", "simpo", "cpo")
DPO_LOSSES = ("sigmoid", "ipo", "hinge", "robust", "sft")


class PreferenceSection(Section):
    """Preference tuning of a causal LM (TRL's trainers: DPO, ORPO, CPO/SimPO, KTO, reward models)."""

    method: Literal["dpo", "orpo", "simpo", "cpo", "kto", "reward"] = Field(
        "dpo",
        description="dpo: Direct Preference Optimization against a reference model; orpo: odds-ratio preference with the SFT loss, no reference; "
        "simpo / cpo: reference-free (SimPO: length-normalised with a margin gamma); kto: unpaired desirable/undesirable completions against a "
        "reference, with TRL's KL term; reward: a reward model (a scalar head) trained on pairs with the pairwise loss.",
    )
    loss_type: list[Literal["sigmoid", "ipo", "hinge", "robust", "sft"]] = Field(
        default_factory=lambda: ["sigmoid"],
        description="DPO's losses, summed with loss_weights (TRL 1.x's loss_type): sigmoid (DPO), ipo, hinge, robust (label-smoothed), "
        "sft (the chosen completions' NLL: ['sigmoid', 'sft'] is RPO, LLaMA-Factory's pref_ftx).",
    )
    loss_weights: list[float] | None = Field(None, description="One weight per loss_type entry (default 1 each).")
    beta: float = Field(0.1, gt=0, description="Inverse temperature of the implicit reward (DPO, KTO, ORPO's lambda, CPO/SimPO's beta).")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="Probability a pair's label is flipped (DPO robust; CPO/SimPO).")
    simpo_gamma: float = Field(0.5, ge=0, description="SimPO's target reward margin gamma.")
    cpo_alpha: float | None = Field(
        None, ge=0, description="Weight of the chosen completions' NLL added to the CPO/SimPO loss; default 1.0 for cpo (TRL's CPOConfig) and 0 for simpo (the SimPO paper)."
    )
    desirable_weight: float = Field(1.0, gt=0, description="KTO: weight of the desirable completions' losses.")
    undesirable_weight: float = Field(1.0, gt=0, description="KTO: weight of the undesirable completions' losses.")
    reference: Literal["auto", "adapters_off", "precomputed"] = Field(
        "auto",
        description="Where the reference model's log-probs come from (dpo, kto): adapters_off, the base with the LoRA adapters disabled "
        "(peft's disable_adapter, no second copy), for LoRA runs; precomputed, computed once by the ranks before training from the "
        "starting weights and cached with the tokens (full fine-tunes). auto: adapters_off with model.lora, else precomputed.",
    )

    @field_validator("loss_type")
    @classmethod
    def _losses_known(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("name at least one loss, e.g. [sigmoid]")
        return value


class ConvertSection(Section):
    """Where a converted config came from, and what `zeropipe convert` found it cannot train (docs/migrate.md)."""

    tool: str = Field(..., description="The tool the source config was written for: diffusion-pipe, axolotl or llama-factory.")
    source: str = Field(..., description="The source config `zeropipe convert` read.")
    cannot_train: list[str] = Field(
        default_factory=list,
        description="Why this config cannot train yet, as `zeropipe convert` said: `zeropipe check` and `zeropipe train` refuse while it is not empty "
        "(rule ZP030). Fix what each line says, then remove the line.",
    )


class RewardSection(Section):
    """One reward function of a GRPO run (``grpo.rewards``); a completion's reward is the weighted sum of them."""

    kind: Literal["answer", "numeric", "format", "length", "model", "function"] = Field(
        ...,
        description="answer: 1 if the completion equals the record's answer (stripped); numeric: 1 if the completion's last number "
        "equals the answer's within tolerance; format: 1 if the regex pattern matches the completion; length: 1 - |characters - "
        "target_length| / target_length, at least -1; model: the score of a reward model (a ZeRO-Pipe reward-model export, "
        "or any transformers sequence-classification directory) on prompt + completion; function: a Python callable "
        "'module:function' called as TRL calls its reward functions, f(prompts, completions, **record_fields) -> list of floats or None.",
    )
    weight: float = Field(1.0, description="This reward's weight in the sum (TRL's reward_weights).")
    name: str | None = Field(None, description="Name in the metrics (rewards/<name>/mean); default the kind (the function's name for function).")
    pattern: str | None = Field(None, description="format: the regular expression (Python re.search) the completion must match.")
    tolerance: float = Field(1e-6, ge=0, description="numeric: the largest difference still counted as equal.")
    target_length: PositiveInt | None = Field(None, description="length: the completion length in characters that scores 1.")
    path: str | None = Field(None, description="model: the reward model's directory (zeropipe export of a preference.method reward run).")
    function: str | None = Field(
        None,
        description="function: 'package.module:function', imported on every rank. A config submitted through the web UI may name one only "
        "when the UI was started with --allow-remote-code (it runs Python code on this machine).",
    )


class GRPOSection(Section):
    """Online reinforcement learning of a causal LM with GRPO and TRL 1.16's loss variants (docs/rl.md)."""

    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] = Field(
        "dapo",
        description="TRL 1.16's loss_type: grpo (per-sequence token means), bnpo (batch token mean), dr_grpo (token sum / "
        "max_completion_length), dapo (token sum / the generation batch's tokens, TRL's default), cispo, sapo, luspo, vespo.",
    )
    num_generations: int = Field(8, ge=2, description="Completions sampled per prompt (the group whose rewards set each one's advantage).")
    max_completion_length: PositiveInt = Field(256, description="Most new tokens per completion; one that reaches it without EOS is truncated.")
    beta: float = Field(0.0, ge=0, description="Weight of the KL penalty to the reference (TRL's default 0: no reference pass).")
    epsilon: float = Field(0.2, gt=0, description="Lower clip of the importance ratio (1 - epsilon); the upper too unless epsilon_high is set.")
    epsilon_high: float | None = Field(None, gt=0, description="Upper clip (1 + epsilon_high; DAPO's clip-higher recommends 0.28); cispo's cap.")
    delta: float | None = Field(None, gt=1, description="Two-sided clipping: the unclipped ratio is capped at delta (INTELLECT-2).")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Advantages divided by the group's reward std (group), the micro-batch's (batch) or not at all (none, Dr. GRPO)."
    )
    importance_sampling_level: Literal["token", "sequence"] = Field("token", description="Importance ratio per token or per sequence (GSPO).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature; the log-probs are computed from the logits divided by it, as TRL does.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling.")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0: off).")
    mask_truncated_completions: bool = Field(False, description="Completions that hit max_completion_length without EOS are left out of the loss (DAPO).")
    reference: Literal["auto", "adapters_off", "copy"] = Field(
        "auto", description="The KL reference (beta > 0): adapters_off, the base with the LoRA adapters disabled (needs model.lora); copy, a frozen "
        "copy of model.path, partitioned over the ranks under ZeRO-3. auto: adapters_off with LoRA, copy for a full fine-tune."
    )
    num_iterations: int = Field(
        1, ge=1, description="Optimisation steps per generation (TRL's num_iterations): the completions of one step are trained on this many "
        "steps, the importance ratio against the sampling policy's log-probs clipped; 1 (TRL's default): sample every step."
    )
    rewards: list[RewardSection] = Field(
        default_factory=lambda: [RewardSection(kind="numeric")], description="The reward functions; default: numeric match with the record's answer."
    )
    samples_every: int = Field(1, ge=0, description="Write the first prompt's completions of every n-th step to RUN/completions.jsonl (0: never).")


class RunConfig(Section):
    run: RunSection = Field(default_factory=RunSection, description="Where the run is written and its seed.")
    model: ModelSection = Field(default_factory=ModelSection, description="What model is trained.")
    data: DataSection = Field(default_factory=DataSection, description="What it is trained on.")
    train: TrainSection = Field(default_factory=TrainSection, description="How long and how fast it is trained.")
    generate: GenerateSection = Field(default_factory=GenerateSection, description="Generations printed at the end of the run.")
    logging: LoggingSection = Field(default_factory=LoggingSection, description="Where metrics go besides metrics.jsonl.")
    deepspeed: DeepSpeedSection = Field(default_factory=DeepSpeedSection, description="ZeRO stage, offload and precision.")
    hardware: HardwareSection = Field(default_factory=HardwareSection, description="How many ranks, on what.")
    parallel: ParallelSection = Field(default_factory=ParallelSection, description="Sequence parallelism: ranks that share one sample's tokens.")
    preference: PreferenceSection | None = Field(
        None, description="Preference tuning (DPO, ORPO, SimPO/CPO, KTO, reward model) instead of supervised fine-tuning; docs/preference.md."
    )
    grpo: GRPOSection | None = Field(
        None, description="Online reinforcement learning with GRPO (completions sampled by the policy, scored by reward functions) instead of supervised fine-tuning; docs/rl.md."
    )
    stages: list[StageSection] | None = Field(
        None,
        description="A curriculum: stages run one after the other, each the top-level config with its own model/data/train/deepspeed "
        "keys merged over it, each starting from the weights the previous stage ended with. Every stage is checked and its data "
        "prepared before the first starts; `zeropipe train --resume` continues the stage that was running, at its last checkpoint.",
    )
    convert: ConvertSection | None = Field(
        None, description="Written by `zeropipe convert`: the source config, and why the conversion cannot train yet (refused by check and train while set)."
    )
