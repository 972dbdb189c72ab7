"""Vision-language models (LLaVA-, Qwen2-VL-, Gemma 3-style) through AutoModelForImageTextToText.

Detected by a ``vision_config`` in the model's config. The launcher reads and checks the
image-text data and builds (or copies) the processor (``prepare.py``); the rank task is
:class:`~zeropipe.families.vlm.task.VisionLanguageTask`; export writes the model with its
processor; generation takes an image with each prompt (``generate.py``). A ``preference:`` section
trains on pairs with images instead (``preference.py``: DPO, CPO, SimPO).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from zeropipe.config.schema import ModelSection, RunConfig
from zeropipe.export.hf import ExportJob, write_transformers_export
from zeropipe.families.base import read_model_config_json, text_only_problems
from zeropipe.families.vlm import generate as vlm_generate
from zeropipe.families.vlm.model import build_vlm_for_export, vlm_config
from zeropipe.families.vlm.preference import VlmPreferenceTask, prepare_vlm_preference_data, vlm_preference_problems
from zeropipe.families.vlm.prepare import prepare_vlm_data
from zeropipe.families.vlm.spec import vlm_config_spec
from zeropipe.families.vlm.task import VisionLanguageTask
from zeropipe.models.common import hidden_size_of, trained_weights
from zeropipe.rundir import PreparedData, RunDir


class VisionLanguage:
    name = "vlm"
    trains_tokenizer = False
    resumes_on_other_rank_counts = True  # its batches count the data for all ranks together (engine.task.SamplerBatches)
    answers_prompts = True
    evaluates_loss = False  # zeropipe eval reads text-only held-out data
    takes_images = True
    streams_answers = False
    sequence_parallel_refusal = ("the image tokens are merged into the sequence inside the model, after the split DeepSpeed's "
                                 "Ulysses needs; only causal language models train with sequence parallelism")

    def detect(self, section: ModelSection) -> bool:
        config = read_model_config_json(section)
        return config is not None and "vision_config" in config

    def detect_dir(self, path: Path) -> bool:
        try:
            return "vision_config" in json.loads((Path(path) / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            return False

    def config_problems(self, config: RunConfig) -> list[tuple[str, str]]:
        return text_only_problems(config, self.name) + vlm_preference_problems(config)

    def curriculum_problems(self, config: RunConfig) -> list[tuple[str, str]]:
        if config.model.path or config.model.processor:
            return []
        # Each stage tokenizes its data before the first starts: they must all use one processor.
        return [("model.processor", "a vision-language curriculum built from model.config needs one processor for every stage: set model.processor to a saved processor directory, or use model.path")]

    def hidden_size(self, config: RunConfig) -> int | None:
        return hidden_size_of(vlm_config(config.model))

    def prepare_data(self, config: RunConfig, run: RunDir, reuse: bool) -> PreparedData:
        if config.preference is not None:
            return prepare_vlm_preference_data(config, run, reuse)
        return prepare_vlm_data(config, run, reuse)

    def rank_task(self, trainer) -> VisionLanguageTask:
        # Preference tuning is another task on the same model: another loss, data and reference, the same loop.
        return VlmPreferenceTask(trainer) if trainer.config.preference is not None else VisionLanguageTask(trainer)

    def model_spec(self, config: RunConfig):
        return vlm_config_spec(config)

    def export(self, job: ExportJob) -> Path:
        # AutoModelForImageTextToText, with adapters only on the parts that trained.
        model = build_vlm_for_export(job.config.model)
        # An fp8 base's checkpoint holds the base as bytes: the export takes the adapters from it, the base from model.path.
        return write_transformers_export(job, model, trained_weights(model, job.config.model, job.state_dict()))

    def load_for_generate(self, source, device: torch.device, dtype: torch.dtype):
        return vlm_generate.load_for_generation(source, device, dtype)

    def generate(self, loaded, prompts, images, tokens, temperature, top_p, seed, raw, streamer=None):
        return vlm_generate.generate_with_images(loaded, prompts, images, tokens, temperature, top_p, seed, streamer)


FAMILY = VisionLanguage()
