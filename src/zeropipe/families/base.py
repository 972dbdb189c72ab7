"""What a model family is: the interface every family module fills in."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from zeropipe.config.schema import ModelSection, RunConfig
    from zeropipe.engine.task import RankTask
    from zeropipe.engine.trainer import Trainer
    from zeropipe.export.generate import Generation, LoadedModel, ModelSource
    from zeropipe.export.hf import ExportJob
    from zeropipe.plan.model_spec import ModelSpec
    from zeropipe.rundir import PreparedData, RunDir

# Data features implemented for the token pipeline of causal language models only.
TEXT_ONLY_DATA_KEYS = ("packing", "group_by_length", "eval_path", "eval_fraction", "mixture")


class Family(Protocol):
    """One model family (causal LM, vision-language, diffusion...): everything that differs by what is trained.

    Every place that used to ask "which family is this?" calls one of these instead. The
    registry (:mod:`zeropipe.families`) finds the family of a config or a directory.
    """

    name: str  # written into config.yaml as model.family
    trains_tokenizer: bool  # a model without a tokenizer gets one trained on the data (curricula train one for all stages)
    answers_prompts: bool  # zeropipe generate and the UI's Generate page write its answers
    evaluates_loss: bool  # zeropipe eval (and the UI's Evaluate) computes its loss on held-out data (a language model's perplexity too)
    takes_images: bool  # a prompt may come with an image
    streams_answers: bool  # generate() passes answers token by token to a streamer
    # Optional (read with getattr, default False): its rank task's batches report a global data
    # position (engine.task.SamplerBatches), so a run resumes on another number of ranks.
    resumes_on_other_rank_counts: bool
    # Optional (read with getattr, default False): it draws pictures outside training, for the
    # UI's Draw page, with ``load_for_drawing(source, device, dtype) -> LoadedModel`` and
    # ``draw(loaded, out_dir, prompt, negative_prompt, width, height, steps, guidance, seed, frames)``
    # (the diffusion family's ``draw.py``); ``zeropipe.families.load_drawing`` / ``draw`` ask it.
    draws_images: bool
    # Optional (read with getattr, default: refused): why parallel.sequence_parallel_size > 1 cannot train this
    # family, or None where its rank task splits sequences over a group (the causal LM; docs/parallel.md).
    sequence_parallel_refusal: str | None
    # Optional (read with getattr, default False): the family's rank task takes parallel.tiled_loss (the causal LM's
    # next-token loss, families/causal_lm/tiled_loss.py); check ZP048 refuses tiled_loss: true elsewhere.
    tiles_its_loss: bool
    # Optional (read with getattr): ``evaluate_held_out(run, info, dtype)``, the family's own `zeropipe eval` of a checkpoint on
    # the held-out data it kept (the diffusion family's validation loss); without it `zeropipe eval` is the language models'.

    def detect(self, section: "ModelSection") -> bool:
        """Whether model.path / model.config holds a model of this family (model.family: auto)."""

    def detect_dir(self, path: Path) -> bool:
        """Whether an exported or downloaded model directory holds a model of this family."""

    def config_problems(self, config: "RunConfig") -> list[tuple[str, str]]:
        """(key, message with the fix) for settings this family cannot run; checked before any process starts."""

    def curriculum_problems(self, config: "RunConfig") -> list[tuple[str, str]]:
        """The same, for a multi-stage curriculum of this family."""

    def hidden_size(self, config: "RunConfig") -> int | None:
        """The model's hidden size (DeepSpeed's bucket sizes), or None where it has none."""

    def prepare_data(self, config: "RunConfig", run: "RunDir", reuse: bool) -> "PreparedData":
        """In the launcher: read, check and cache the data; write what the ranks read into the run directory."""

    def rank_task(self, trainer: "Trainer") -> "RankTask":
        """Inside a rank: the family's part of training."""

    def model_spec(self, config: "RunConfig") -> "ModelSpec":
        """The planner's description of the configured model (counted on the meta device)."""

    def export(self, job: "ExportJob") -> Path:
        """Write a checkpoint as what this family's libraries load (transformers, peft, diffusers)."""

    def load_for_generate(self, source: "ModelSource", device: torch.device, dtype: torch.dtype) -> "LoadedModel":
        """The model of a run, export or adapter, ready for :meth:`generate`."""

    def generate(
        self,
        loaded: "LoadedModel",
        prompts: list[str | list[dict[str, str]]],
        images: list[str | None],
        tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
        raw: bool,
        streamer: Any = None,
    ) -> list["Generation"]:
        """Answers to prompts (with an image each, for families that take them); ``streamer`` gets tokens as they come, where the family streams.

        A prompt is one user turn's text or a whole conversation (``export.generate.as_messages``:
        system, user and assistant messages ending with a user turn), rendered with the template
        the model was trained with; each answer's ``prompt_tokens`` says how long that rendering was.
        """


def text_only_problems(config: "RunConfig", family: str, bitsandbytes_base: bool = False, held_out_data: bool = False) -> list[tuple[str, str]]:
    """The causal-LM features (data features, QLoRA's 4-bit base) a run of another family set.

    A ``preference:`` section is each family's to accept or refuse (the VLM trains it; diffusion refuses it).
    ``bitsandbytes_base``: the family loads an nf4/fp4/int8 base itself (diffusion, ``models.bnb_base``), so it is not refused here.
    ``held_out_data``: the family evaluates data.eval_path / data.eval_fraction itself (diffusion's validation loss).
    """
    problems = [
        (f"data.{key}", f"is implemented for causal language models only, and this is a {family} run: remove it")
        for key in TEXT_ONLY_DATA_KEYS
        if getattr(config.data, key) and not (held_out_data and key in ("eval_path", "eval_fraction"))
    ]
    if getattr(config, "grpo", None) is not None:
        problems.append(("grpo", f"GRPO (online reinforcement learning) is implemented for causal language models, and this is a {family} run: remove grpo"))
    if config.model.quantization is not None and not config.model.quantization.is_fp8 and not bitsandbytes_base:
        # Said before anything starts: the diffusion family would ignore it, the VLM's ranks fail on it.
        problems.append(
            (
                "model.quantization",
                f"{config.model.quantization.storage} storage (bitsandbytes) is implemented for causal language models and diffusion models, and this is a {family} run: "
                "set model.quantization: fp8 (any family), or remove it (LoRA on the 16-bit model stays: model.lora)",
            )
        )
    return problems


def read_model_config_json(section: "ModelSection") -> dict[str, Any] | None:
    """model.path's config.json (None when unreadable), or the inline model.config."""
    import json

    if section.path:
        try:
            return json.loads((Path(section.path).expanduser() / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            return None
    return section.config or {}
