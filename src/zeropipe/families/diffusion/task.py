"""The diffusion model's part of a rank: fill the caches -> train the denoiser -> sample images.

The :class:`~zeropipe.engine.trainer.Trainer` holding this task does the rest (DeepSpeed
engine, optimizer steps, metrics, checkpoints, resume). What is particular here:

- The caches were filled before the ranks started, by one process per node
  (:func:`zeropipe.families.diffusion.prepare.fill_caches`), so that a node holds one copy of the VAE
  and the text encoders (UMT5-XXL alone is about 11 GB in bf16) whatever its number of GPUs.
  With the caches on (the default) the ranks never load them: only the denoiser is in
  memory (rank 0 loads the VAE for a moment to decode samples). Each metrics row says which
  frozen components this rank holds (``frozen_components_loaded``).
- What differs between architectures (how prompts are encoded, how the denoiser is called,
  the sampler's arguments) is asked of the run's architecture entry
  (``zeropipe.families.diffusion.entries``); nothing here names an architecture.
- Only the denoiser (UNet or transformer) is given to DeepSpeed, and with LoRA only its
  adapters: frozen weights get no gradients and no optimizer state.
- Noise, timesteps, flips and caption dropout come from this rank's own random streams
  (seeded by rank, saved with every checkpoint), so ranks see different noise and a
  resumed run continues exactly.
"""

from __future__ import annotations

import gc
import json
import logging
import random
from pathlib import Path
from typing import Any

import torch

from zeropipe.families.diffusion import cache
from zeropipe.families.diffusion.entries import PredictContext, architecture_named
from zeropipe.data.images import PreparedImage
from zeropipe.families.diffusion.buckets import epoch_micro_batches
from zeropipe.families.diffusion.objectives import DDPMObjective, FlowObjective
from zeropipe.families.diffusion.parts import Encoding, Inputs, Sampling
from zeropipe.families.diffusion.pipelines import (
    PipelineFolder,
    denoising_pipeline,
    denormalize_latents,
    encode_prompts,
    latent_scaling,
    load_component,
    normalize_latents,
    single_file_renamer,
    stack_padded,
    text_pipeline,
    vae_scale_factor,
)
from zeropipe.engine.task import TaskDefaults
from zeropipe.errors import DataError
from zeropipe.families.diffusion.prepare import load_item_pixels, planned_conditions, read_plan
from zeropipe.models.adapters import peft_adapter_config
from zeropipe.models.checkpointing import enable_checkpointing
from zeropipe.models.common import TORCH_DTYPES, count_parameters, encoder_precision_for, hf_zero3_config, resolve_lora_targets
from zeropipe.models.loading import load_pretrained
from zeropipe.models.bnb_base import BitsAndBytesStorage
from zeropipe.models.quantized import QuantizedStorage

log = logging.getLogger("zeropipe")


def base_storage(quant) -> QuantizedStorage | BitsAndBytesStorage | None:
    """How model.quantization stores the denoiser's block linears: fp8 bytes (any ZeRO stage) or bitsandbytes' nf4/fp4/int8 layers (ZeRO-0..2)."""
    if quant is None:
        return None
    return QuantizedStorage(quant.storage, quant.scale) if quant.is_fp8 else BitsAndBytesStorage(quant.storage, quant.double_quant)


def one_prompt(kwargs: dict[str, Any], number: int, prompts: int) -> dict[str, Any]:
    """A pipeline call's arguments for one of its prompts: the batched tensors (one row per prompt) sliced to that row."""
    return {key: value[number : number + 1] if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == prompts else value for key, value in kwargs.items()}


def release_memory() -> None:
    """Give freed host memory back to the system, so the RSS in the metrics shows the saving."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class DiffusionTask(TaskDefaults):
    # ------------------------------------------------------------------ setup
    def setup_data(self) -> None:
        import diffusers
        import transformers

        # Per-component progress bars in rank logs tell nothing the log lines do not.
        transformers.utils.logging.disable_progress_bar()
        diffusers.utils.logging.disable_progress_bar()
        self.data = read_plan(self.run)
        self.arch = architecture_named(self.data.architecture)
        self.pipeline_dir = Path(self.data.pipeline_dir)
        self.cache_dir = Path(self.data.cache_dir)
        self.folder = PipelineFolder(self.pipeline_dir, self.arch)
        # The conditions the launcher chose: those this pipeline folder has (Wan 2.2 I2V has no image encoder for Wan 2.1's embeddings) and the settings ask for.
        self.conditions = planned_conditions(self.arch, self.folder, self.data)
        self.latent_shift, self.latent_scale = latent_scaling(self.pipeline_dir, self.arch)
        self.vae_factor = vae_scale_factor(self.pipeline_dir)
        self.compute_dtype = TORCH_DTYPES[self.config.deepspeed.precision]
        self.images = self.config.data.images
        self.vae = None
        self.text_encoders = None  # a pipeline holding only the text encoders
        self.skipped_images: set[str] = set()
        self.timesteps_drawn: list[torch.Tensor] = []  # since the last metrics row: what min_t/max_t restricted
        # The caches were filled before this rank started (diffusion.prepare.fill_caches, one process per node).
        # Without them each rank encodes, with the encoders in the dtype the node's setup process
        # would load them in (bf16 where the device computes in it; the VAE in fp32), as planned.
        if not self.config.data.cache.latents:
            self.vae = load_component(self.pipeline_dir, "vae", torch.float32, self.device)
        encoder_precision, _ = encoder_precision_for(self.plan.accelerator, self.plan.native_precision, self.plan.native_precision_why)
        self.encoder_dtype = TORCH_DTYPES[encoder_precision]
        if not self.config.data.cache.text:
            self.text_encoders = text_pipeline(self.pipeline_dir, self.arch, self.encoder_dtype, self.device)
        scheduler_config = self.folder.files.scheduler_config()
        objective = DDPMObjective if self.arch.record.objective == "ddpm" else FlowObjective
        self.objective = objective(scheduler_config, self.config.model.diffusion)

    @property
    def original_lora_layout(self):
        """The entry's original (ComfyUI) LoRA layout: model.lora.init_from reads those names back (models.adapter_init)."""
        return self.arch.layouts.original_lora_layout

    def build_model(self) -> tuple[torch.nn.Module, dict[str, Any]]:

        cls = self.arch.model_class()
        folder = self.pipeline_dir / self.data.denoiser

        def construct():
            return cls.from_config(cls.load_config(str(folder)))

        weights, rename = folder, None
        single_file = self.config.model.diffusion.denoiser_file
        if single_file:  # an original/ComfyUI-layout file: the directory gives the config, the file the weights
            weights = Path(single_file).expanduser()
            rename = single_file_renamer(self.arch.record.denoiser_class, weights)
        quant = self.config.model.quantization
        model = load_pretrained(
            construct, weights, dtype=self.compute_dtype, zero_stage=self.plan.zero_stage, ds_config=self.trainer.ds_config, stem="diffusion_pytorch_model", rename=rename,
            quantize=base_storage(quant),
        )
        section = self.config.model
        if section.gradient_checkpointing:
            enable_checkpointing(model, offload=self.config.train.activation_offload)
        if section.lora is not None:
            model.requires_grad_(False)
            lora = section.lora
            # peft gathers a ZeRO-3 partitioned base layer where an adapter's initialisation reads it (DoRA's
            # weight norms) only while transformers knows the run is ZeRO-3: its config kept alive around the call.
            zero3 = hf_zero3_config(self.trainer.ds_config, self.plan.zero_stage)
            model.add_adapter(peft_adapter_config(lora, resolve_lora_targets(lora, self.arch.record.lora_targets), gaussian_init=True))
            del zero3
            for param in model.parameters():
                if param.requires_grad:
                    param.data = param.data.to(self.compute_dtype)
        model.train()
        if self.trainer.sequence_parallel > 1:  # Ulysses over the heads through diffusers' context-parallel plan (sequence_parallel.py)
            from zeropipe.families.diffusion import sequence_parallel

            self.trainer.mpu = sequence_parallel.enable_for_run(model, self.trainer)
        trainable, total = count_parameters(model)
        log.info("%s %s: %s parameters, %s trainable (%.2f%%)", self.arch.record.name, self.data.denoiser, f"{total:,}", f"{trainable:,}", 100 * trainable / max(total, 1))
        return model, {"trainable": trainable, "total": total}

    def after_initialize(self) -> None:
        # From here each rank draws its own noise (the model, LoRA init included, was built
        # from the shared seed); the trainer saves and restores these streams with checkpoints.
        # Under sequence parallelism the ranks of a group draw alike (one seed per data-parallel rank): one sample, its noise and timestep.
        seed = self.config.run.seed * 1009 + self.trainer.data_rank
        torch.manual_seed(seed)
        random.seed(seed)
        self.predict_context = PredictContext(self.device, self.compute_dtype, self.vae_factor, self.config.model.diffusion.guidance)

    # ------------------------------------------------------------------ train
    def batches(self, start_step: int):
        """Micro-batches of item indices (one bucket each) from the current position, epoch after epoch."""
        per_epoch = self.plan.micro_batches_per_epoch
        micro_step = start_step * self.accumulation
        while True:
            epoch, position = divmod(micro_step, per_epoch)
            mine = epoch_micro_batches(
                [tuple(b) for b in self.data.buckets], self.data.repeats, self.micro_batch_size, self.trainer.data_world, self.config.run.seed, epoch
            )[self.trainer.data_rank]
            for indices in mine[position:per_epoch]:
                yield epoch, indices
                micro_step += 1

    def forward_loss(self, indices: list[int]) -> tuple[torch.Tensor, float, float]:
        latents, condition = self.assemble(indices)
        noised = self.objective.noise(latents)
        self.timesteps_drawn.append(noised.timesteps.detach().float())  # on the device: read when the metrics are written
        if self.trainer.sequence_parallel > 1:  # the group's loss of its one micro-batch, counted once (sequence_parallel.py)
            from zeropipe.families.diffusion import sequence_parallel

            return sequence_parallel.group_loss(self, lambda: self.arch.call.loss(self.engine, noised, condition, self.predict_context), noised.model_input, len(indices))
        return self.arch.call.loss(self.engine, noised, condition, self.predict_context), 0.0, float(len(indices))

    def assemble(self, indices: list[int], augment: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Latents and conditioning of a micro-batch: from the caches, or encoded now (one encoder call per micro-batch) when they are off."""
        distributions, time_ids, texts, chosen, dropped_flags = [], [], [], [], []
        usable = [i for i in indices if self.data.items[i]["path"] not in self.skipped_images] or list(indices)
        for index in indices:
            if index not in usable:
                index = random.choice(usable)
            item = self.data.items[index]
            flip_choice = augment and random.random() < self.images.flip
            source, sizes = self.image_source(index, flip_choice)
            if source is None:  # unreadable now: another image of the same bucket stands in
                source, sizes = self.image_source(random.choice([i for i in usable if i != index] or usable), flip_choice)
            distributions.append(source)
            time_ids.append(sizes)
            dropped = augment and random.random() < self.images.caption_dropout
            texts.append("" if dropped else item["caption"])
            chosen.append(index)
            dropped_flags.append(dropped)
        if not self.config.data.cache.latents:  # pixels of one bucket: one VAE call for the micro-batch
            pixels = self.arch.record.codec.vae_pixels(torch.stack([source for source, _ in distributions]))
            means, stds = self.arch.record.codec.encode(self.vae, pixels)
            values = [
                condition.encode(Encoding(self.vae, pixels, [loaded[number] for _, loaded in distributions], None, self.arch.record.codec, self.device))
                for number, condition in enumerate(self.conditions)
            ]
            distributions = [(mean, std, [value[position] for value in values]) for position, (mean, std) in enumerate(zip(means, stds))]
        latents = [mean + std * torch.randn(mean.shape) for mean, std, _ in distributions]
        condition = self.arch.record.text.batch(self, texts, chosen, dropped_flags)
        condition["time_ids"] = torch.stack(time_ids).to(self.device, self.compute_dtype)
        batch = Inputs(self.device, self.compute_dtype, self.normalize)
        for number, part in enumerate(self.conditions):  # each condition's cached values -> its denoiser inputs
            condition.update(part.inputs([values[number] for _, _, values in distributions], batch))
        return self.normalize(torch.stack(latents).to(self.device)), condition

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE latents -> what the denoiser sees: the codec's layout, normalised, in the compute dtype."""
        return normalize_latents(self.arch.record.codec.from_vae(latents), self.latent_shift, self.latent_scale).to(self.compute_dtype)

    def image_source(self, index: int, flip: bool) -> tuple[Any, torch.Tensor]:
        """What one image contributes before its latents are drawn, and its SDXL size conditioning.

        With the latent cache: its (mean, std, the conditions' values) from the cache. Without: its
        pixels and what each condition loads, which the caller encodes with the rest of the
        micro-batch. ``None`` when it cannot be read.
        """
        item = self.data.items[index]
        bucket = tuple(self.data.buckets[index])
        if self.config.data.cache.latents:
            keys = self.data.latent_keys[index]
            key = keys[1] if flip and len(keys) > 1 else keys[0]
            try:
                entry = cache.load_entry(self.cache_dir, "latents", key)
            except (OSError, RuntimeError) as err:
                self.skip_image(item["path"], f"cached latents unreadable ({err})")
                return None, torch.zeros(6)
            sizes = torch.cat([entry["original_size"], entry["crop_top_left"], entry["target_size"]]).float()
            return (entry["mean"], entry["std"], [entry[condition.entry] for condition in self.conditions]), sizes
        try:
            prepared = self.load_pixels(index, bucket, crop=self.images.crop, flip=flip, rng=random)
            loaded = [condition.load(self.data, index, bucket, flip) for condition in self.conditions]
        except DataError as err:
            self.skip_image(item["path"], str(err))
            return None, torch.zeros(6)
        sizes = torch.tensor([*prepared.original_size, *prepared.crop_top_left, *prepared.target_size], dtype=torch.float32)
        return (prepared.pixels, loaded), sizes

    def load_pixels(self, index: int, bucket: tuple[int, ...], crop: str, flip: bool, rng=None) -> PreparedImage:
        return load_item_pixels(self.data, index, bucket, crop, flip, rng)

    def skip_image(self, path: str, reason: str) -> None:
        if path not in self.skipped_images:
            self.skipped_images.add(path)
            log.warning("rank %d: skipping %s from now on: %s", self.rank, path, reason)

    def text_condition(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """Text-encoder outputs for a batch of captions: from the cache, else encoded now (in one call).

        With ``data.cache.text`` off only the sample prompts and the empty caption come from
        the cache (a run that cached everything before may have left the rest there too).
        """
        rows: list[dict[str, torch.Tensor] | None] = []
        for text in texts:
            key = self.data.text_keys.get(text)
            cacheable = self.config.data.cache.text or text == "" or text in self.plan.generate_prompts
            rows.append(cache.load_entry(self.cache_dir, "text", key) if key is not None and cacheable and cache.has_entry(self.cache_dir, "text", key) else None)
        todo = sorted({text for text, row in zip(texts, rows) if row is None})
        if todo:
            if self.text_encoders is None:
                self.text_encoders = text_pipeline(self.pipeline_dir, self.arch, self.encoder_dtype, self.device)
            encoded = dict(zip(todo, encode_prompts(self.text_encoders, self.arch, todo, self.device)))
            rows = [row if row is not None else encoded[text] for text, row in zip(texts, rows)]
        return {name: stack_padded([row[name] for row in rows]).to(self.device, self.compute_dtype) for name in rows[0]}

    def text_entries(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """Text cache entries by key, stacked: the prompt part's, where the conditioning depends on more than the caption (edit training)."""
        rows = [cache.load_entry(self.cache_dir, "text", key) for key in keys]
        return {name: stack_padded([row[name] for row in rows]).to(self.device, self.compute_dtype) for name in rows[0]}

    def predict(self, model_input: torch.Tensor, timesteps: torch.Tensor, condition: dict[str, torch.Tensor]) -> torch.Tensor:
        """The denoiser's output for a batch, called as the architecture's pipeline calls it."""
        return self.arch.call.predict(self.engine, model_input, timesteps, condition, self.predict_context)

    @torch.no_grad()
    def fixed_batch_loss(self) -> float:
        """The loss on a fixed batch with fixed noise, timesteps and captions, averaged over ranks.

        The training loss of a diffusion model jumps with the timesteps drawn; this one does
        not, so comparing it before and after training shows whether the model learned.
        """
        import deepspeed.comm as dist

        state = (torch.get_rng_state(), random.getstate())
        data_rank = self.trainer.data_rank  # the rank itself, or its sequence-parallel group
        torch.manual_seed(self.config.run.seed + 7919 * data_rank)
        random.seed(self.config.run.seed + data_rank)
        # No caption dropout or flips: the same inputs each time it is measured.
        indices = epoch_micro_batches([tuple(b) for b in self.data.buckets], self.data.repeats, self.micro_batch_size, self.trainer.data_world, self.config.run.seed, 0)[data_rank][0]
        latents, condition = self.assemble(indices, augment=False)
        generator = torch.Generator().manual_seed(self.config.run.seed + data_rank)
        noised = self.objective.noise(latents, generator=generator)
        was_training = self.engine.module.training
        self.engine.module.eval()
        loss = self.arch.call.loss(self.engine, noised, condition, self.predict_context).float()
        if was_training:
            self.engine.module.train()
        torch.set_rng_state(state[0])
        random.setstate(state[1])
        total = loss.detach().to(self.device, torch.float64).reshape(1)
        dist.all_reduce(total)
        return float(total) / self.world_size

    def before_train(self) -> None:
        self.fixed_loss_start = self.fixed_batch_loss() if self.step == 0 else None

    def after_train(self) -> None:
        self.fixed_loss_end = self.fixed_batch_loss()
        if self.rank == 0:
            log.info("loss on a fixed batch (fixed noise and timesteps): %s -> %.4f", f"{self.fixed_loss_start:.4f}" if self.fixed_loss_start is not None else "(resumed)", self.fixed_loss_end)

    def summary_fields(self) -> dict[str, Any]:
        return {"fixed_batch_loss_start": self.fixed_loss_start, "fixed_batch_loss_end": self.fixed_loss_end, "images_skipped": len(self.skipped_images)}

    def extra_metrics(self) -> dict[str, Any]:
        loaded = [name for name, part in (("vae", self.vae), ("text_encoders", self.text_encoders)) if part is not None]
        row: dict[str, Any] = {"frozen_components_loaded": loaded, "images_skipped": len(self.skipped_images)}
        if self.timesteps_drawn:
            # This rank's range of training timesteps since the last row (scheduler units: 0-1000):
            # it shows that an expert's min_t/max_t range is the one trained.
            # Tensors on the device: the trainer reads them when it writes the rows, not every step.
            drawn = torch.cat(self.timesteps_drawn)
            row["timestep_min"], row["timestep_max"] = drawn.min(), drawn.max()
            self.timesteps_drawn = []
        return row

    def after_step(self) -> None:
        every = self.config.train.eval_every
        if self.data.eval_items and ((every and self.step % every == 0) or self.step == self.plan.total_steps):
            self.evaluate()
        every = self.config.generate.sample_every
        if every and self.step % every == 0 and self.step < self.plan.total_steps:
            self.sample_images()

    def evaluate(self) -> dict[str, Any]:
        """The validation loss on the held-out items (families/diffusion/validation.py); a collective, rank 0 writes the row."""
        import time

        from zeropipe.families.diffusion.validation import eval_record, evaluate_in_ranks

        started = time.perf_counter()
        module = self.engine.module
        was_training = module.training
        module.eval()
        table = evaluate_in_ranks(self)
        if was_training:
            module.train()
        record = eval_record(self.step, table, time.perf_counter() - started)
        if self.rank == 0:
            record["time"] = time.time()
            with open(self.run.metrics, "a") as handle:
                handle.write(json.dumps(record) + "\n")
            self.trainer.sinks.log(record)
            log.info("step %d validation loss %.4f (%d held-out item(s) at %d fixed timesteps, %.1f s)", self.step, record["eval_loss"],
                     record["eval_examples"], len(record["eval_loss_by_quantile"]), record["eval_time_s"])
        return record

    def generate_samples(self) -> None:
        self.sample_images()

    # ------------------------------------------------------------------ samples
    def sampling_vae(self):
        if self.vae is None:
            self.vae = load_component(self.pipeline_dir, "vae", torch.float32, self.device)
        return self.vae

    @torch.no_grad()
    def sample_images(self) -> None:
        """Draw the configured prompts with the current weights; every rank runs the denoiser, rank 0 decodes and writes.

        Each part of the entry adds what it needs: the components the pipeline holds while
        sampling (the VAE where it encodes a first frame or a control image), and its arguments
        (the first frame; a control image per prompt, which makes one pipeline call per prompt).
        The codec writes the samples: PNG files, or H.264 mp4 files with an animated WebP beside each.
        """
        prompts = self.plan.generate_prompts
        if not prompts:
            return
        generate = self.config.generate
        size = self.images.resolution
        condition, negative = self.arch.record.text.samples(self, prompts)
        module = self.engine.module
        was_training = module.training
        module.eval()
        codec = self.arch.record.codec
        sampling = Sampling(prompts, size, codec.sample_bucket(size), self.data, self.folder, self.device, self.load_pixels, self.sampling_vae)
        parts = [codec, *self.conditions]
        frozen: dict[str, Any] = {}
        for part in parts:
            frozen.update(part.sample_components(sampling))
        pipeline = denoising_pipeline(self.pipeline_dir, self.arch, module, **frozen)
        kwargs: dict[str, Any] = {
            "height": size, "width": size, "num_inference_steps": generate.sample_steps,
            "generator": torch.Generator().manual_seed(generate.sample_seed), "output_type": "latent", "return_dict": False,
            **self.arch.sampling.sample_kwargs(condition, negative, generate.guidance_scale, self.config.model.diffusion.guidance),
            **codec.sample_kwargs(self.data),
        }
        per_prompt: list[dict[str, Any]] | None = None
        rows: list[dict[str, Any]] = [{} for _ in prompts]
        for part in self.conditions:
            added = part.sample_inputs(sampling, kwargs)
            kwargs.update(added.kwargs)
            for row, extra in zip(rows, added.rows or []):
                row.update(extra)
            if added.per_prompt is not None:
                per_prompt = [{**(mine or {}), **extra} for mine, extra in zip(per_prompt or [None] * len(prompts), added.per_prompt)]
        pipeline.set_progress_bar_config(disable=True)
        from_ema = self.trainer.ema is not None and self.config.train.ema.sample_from_ema
        for row in rows:
            row["weights"] = "ema" if from_ema else "trained"
        with self.trainer.sampling_weights():
            if per_prompt is not None:  # a part gives each prompt its own arguments (a control image): one call per prompt
                drawn = [self.arch.sampling.sample_outputs(pipeline, {**one_prompt(kwargs, number, len(prompts)), **extra}) for number, extra in enumerate(per_prompt)]
                latents = torch.cat([latent for latent, _ in drawn])
                outputs = {name: torch.cat([other[name] for _, other in drawn]) for name in drawn[0][1]}
            else:
                latents, outputs = self.arch.sampling.sample_outputs(pipeline, kwargs)
        if was_training:
            module.train()
        if self.rank != 0:
            if "vae" in frozen and self.config.data.cache.latents:
                self.vae = None
                release_memory()
            return
        latents = self.arch.sampling.unpack_latents(pipeline, latents, size, self.vae_factor)
        decoded = self.arch.sampling.decoded(pipeline, latents, kwargs, lambda part: codec.vae_images(codec.decode(self.sampling_vae(), denormalize_latents(part.float(), self.latent_shift, self.latent_scale))))
        pixels = ((decoded / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        folder = self.run.path / "samples" / f"step_{self.step:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        written = codec.write_samples(folder, prompts, pixels, self.data, self.step, rows)
        for part in parts:  # what the parts make of the pipeline's other outputs (an audio track muxed into each video)
            part.add_to_samples(sampling, outputs, written, folder)
        with open(self.run.path / "samples" / "index.jsonl", "a") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in written)
        log.info("step %d: %d sample %s written to %s", self.step, len(written), codec.sample_noun, folder)
        if self.config.data.cache.latents:
            # Loaded for the samples only: training goes on without it.
            self.vae = None
            release_memory()


def checkpoint_with_keywords(module, *args, **kwargs):
    """diffusers' default checkpointing function, keyword arguments passed on too.

    diffusers 0.42's default takes positional arguments only, and HunyuanImage's transformer passes
    ``attention_mask=`` to it: with this one every denoiser checkpoints as diffusers' default does.
    """
    import torch.utils.checkpoint

    return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False, **kwargs)
