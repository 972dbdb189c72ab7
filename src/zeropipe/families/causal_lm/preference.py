"""Preference tuning of a causal LM (``preference:`` in the run config): the launcher's pair cache and the rank task.

The task is the causal LM's (same model building, LoRA, ZeRO-3, samples) with another loss
(``engine.preference``): DPO and its variants, ORPO, CPO/SimPO, KTO, or a reward model's
pairwise loss. The reference model of DPO and KTO is never a second copy of the weights:

- LoRA runs (``reference: adapters_off``): the same partitioned model with its adapters
  disabled (peft's ``disable_adapter``), one extra forward pass without gradient per micro-batch;
- full fine-tunes (``reference: precomputed``): every example's reference log-probs computed
  once by the ranks, from the starting weights, right after DeepSpeed is initialised (before a
  resume loads trained weights), each rank a share, and saved beside the pair cache as
  ``RUN/cache/reference_logps.npy``; a resumed run reads them back.

A micro-batch of ``train.micro_batch_size`` pairs is 2 x that many sequences (chosen and
rejected rows in one forward pass, as TRL does). The step's figures (loss, rewards of chosen and
rejected answers, margin, accuracy, log-probs; KTO's KL; ORPO/CPO's NLL) are this rank's
means over the step's micro-batches, kept on the device until the trainer flushes its metrics.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any

import torch

from zeropipe.config.schema import RunConfig
from zeropipe.data.preference import (
    PAIRED,
    UNPAIRED,
    PairDataset,
    build_pair_cache,
    collate_pairs,
    collate_unpaired,
    preference_texts,
    read_pair_info,
)
from zeropipe.data.records import iter_records
from zeropipe.data.sampler import ResumableDistributedSampler
from zeropipe.data.tokenize import pad_token_id
from zeropipe.engine.preference import PreferenceObjective, PreferenceSettings, preference_section_problems, reference_mode, sequence_logps
from zeropipe.families.causal_lm.model import build_model, is_reward_model
from zeropipe.families.causal_lm.prepare import data_columns, prepare_data_file, prepare_tokenizer
from zeropipe.families.causal_lm.task import CausalLMTask
from zeropipe.models.common import count_parameters, hf_zero3_config, hidden_size_of, log_partitioning, model_config
from zeropipe.rundir import PreparedData, RunDir

log = logging.getLogger("zeropipe")


def preference_problems(config: RunConfig) -> list[tuple[str, str]]:
    """(key, message with the fix) for a preference run that cannot work; checked before any process starts."""
    section = config.preference
    if section is None:
        return []
    problems = preference_section_problems(config)
    if section.method == "reward" and config.model.quantization is not None:
        problems.append(("model.quantization", "a reward model's new score head is not trained on a 4-bit base here: remove model.quantization"))
    return problems


def _tokenizer(config: RunConfig, run: RunDir, records_path: Path, reuse: bool):
    """The supervised run's tokenizer (prepare_tokenizer); one trained here learns the pairs' prompts and answers."""
    return prepare_tokenizer(
        config, run, records_path, reuse, texts=lambda: preference_texts(iter_records(records_path, data_columns(config, records_path)))
    )


def prepare_preference_data(config: RunConfig, run: RunDir, reuse: bool) -> PreparedData:
    """The preference records read, checked and tokenized into the run's pair cache (``RUN/cache``)."""
    records_path = prepare_data_file(config, run)
    tokenizer = _tokenizer(config, run, records_path, reuse)
    kind = UNPAIRED if config.preference.method == "kto" else PAIRED
    info = read_pair_info(run.cache) if reuse else None
    if info is None or info.get("kind") != kind:
        built = build_pair_cache(
            iter_records(records_path, data_columns(config, records_path)), tokenizer, run.cache, kind, config.data.max_seq_len, config.data.max_bad_fraction
        )
        info = dict(built.__dict__)
    notes = []
    what = "unpaired examples (KTO)" if kind == UNPAIRED else "preference pairs"
    notes.append(f"preference ({config.preference.method}): {info['examples']} {what} from {records_path}; reference: {reference_mode(config) or 'none (reference-free)'}")
    if kind == UNPAIRED:
        notes.append(f"kto: {info['desirable']} desirable and {info['undesirable']} undesirable examples")
    if info["prompts_truncated"] or info["completions_truncated"]:
        notes.append(
            f"max_seq_len {config.data.max_seq_len}: {info['prompts_truncated']} prompt(s) lost their start and "
            f"{info['completions_truncated']} example(s) their answers' end (prompts are cut first); raise data.max_seq_len to keep them whole"
        )
    if info["bad_record_count"]:
        shown = ", ".join(f"line {b.get('line')}: {b.get('reason')}" for b in info["bad_records"][:3])
        notes.append(f"skipped {info['bad_record_count']} malformed record(s) in {records_path} ({shown})")
    if config.model.config is not None and config.model.config.get("vocab_size") in (None, "auto"):
        config.model.config = {**config.model.config, "vocab_size": len(tokenizer)}
        notes.append(f"model.config.vocab_size = {len(tokenizer)} (from the tokenizer)")
    if is_reward_model(config) and config.model.config is not None and config.model.config.get("pad_token_id") is None:
        # The score is read at each sequence's last token before the padding, found by the pad id.
        config.model.config = {**config.model.config, "pad_token_id": pad_token_id(tokenizer)}
        notes.append(f"model.config.pad_token_id = {pad_token_id(tokenizer)} (the tokenizer's; the reward model reads its score before it)")
    examples = int(info["examples"])
    hf_config = model_config(config.model)
    prompts = [] if is_reward_model(config) else list(config.generate.prompts or [])
    return PreparedData(
        examples=examples,
        hidden_size=hidden_size_of(hf_config),
        micro_batches_per_epoch=lambda micro, world_size: (examples // world_size) // micro,
        prompts=prompts,
        notes=notes,
    )


class PreferenceTask(PreferenceObjective, CausalLMTask):
    """A causal LM (or reward model) trained on preference pairs or KTO's unpaired examples."""

    def setup_data(self) -> None:
        from transformers import AutoTokenizer

        trainer = self.trainer
        self.settings = PreferenceSettings.of(trainer.config.preference)
        self.reference_mode = reference_mode(trainer.config)
        self.tokenizer = AutoTokenizer.from_pretrained(str(trainer.run.tokenizer))
        self.dataset = PairDataset(trainer.run.cache)
        collate = collate_unpaired if self.dataset.kind == UNPAIRED else collate_pairs
        self.collate = partial(collate, pad_token_id=pad_token_id(self.tokenizer))
        self.sampler = ResumableDistributedSampler(len(self.dataset), trainer.rank, trainer.world_size, seed=trainer.config.run.seed, shuffle=True)
        self.eval_dataset = None
        self.reference: torch.Tensor | None = None  # precomputed: (examples, 2) log-probs
        self.step_figures: list[dict[str, torch.Tensor]] = []

    def build_model(self) -> tuple[torch.nn.Module, dict[str, Any]]:
        trainer = self.trainer
        reward = self.settings.method == "reward"
        config = model_config(trainer.config.model)
        if reward:
            config.num_labels = 1
            config.pad_token_id = pad_token_id(self.tokenizer)
        self.hf_ds_config = hf_zero3_config(trainer.ds_config, trainer.plan.zero_stage)
        model = build_model(
            trainer.config.model, config, trainer.config.deepspeed.precision, trainer.plan.zero_stage, reward=reward, activation_offload=trainer.config.train.activation_offload
        )
        if trainer.plan.zero_stage == 3:
            log_partitioning(model)
        trainable, total = count_parameters(model)
        log.info("model: %s parameters, %s trainable (%.2f%%)", f"{total:,}", f"{trainable:,}", 100 * trainable / max(total, 1))
        return model, {"trainable": trainable, "total": total}

    # ------------------------------------------------------------------ loss
    @staticmethod
    def logits(model, batch: dict[str, torch.Tensor], prefix: str = "") -> torch.Tensor:
        return model(input_ids=batch[f"{prefix}input_ids"], attention_mask=batch[f"{prefix}attention_mask"], use_cache=False).logits

    def forward_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float, float]:
        # Counted on the host batch, before it moves: no wait for the device.
        tokens = float(batch["attention_mask"].sum()) + (float(batch["KL_attention_mask"].sum()) if "KL_attention_mask" in batch else 0.0)
        examples = float(batch["index"].shape[0])
        return self.preference_loss(self.batch_to_device(batch)), tokens, examples

    def generate_samples(self) -> None:
        if self.settings.method != "reward":
            super().generate_samples()



# ---------------------------------------------------------------------- zeropipe eval
def preference_run(source: str | Path) -> RunConfig | None:
    """The config of the run ``source`` names (a run or one of its checkpoints) when it is a preference run, else None."""
    source = Path(source)
    root = source.parent.parent if source.parent.name == "checkpoints" else source
    if not RunDir(root).config.is_file():
        return None
    config = RunDir(root).read_config()
    return config if config.preference is not None else None


def evaluate_preference_checkpoint(source: str | Path, data: str | Path, checkpoint: str | None = None, batch_size: int | None = None) -> dict[str, Any]:
    """Preference accuracy of a checkpoint on held-out pairs, in this process on CPU, in fp32.

    The accuracy is what training reports as ``rewards_accuracy``: the share of pairs whose
    chosen answer gets the higher reward (DPO: the implicit reward against the reference, the
    base with the adapters off or model.path's weights; ORPO/CPO/SimPO: the answers' mean or
    summed log-probs; a reward model: its score). KTO runs are scored as DPO on pairs.

    Raises:
        ZeroPipeError: a full DPO/KTO fine-tune of a model built from model.config has no reference
            to compare with outside training; CheckpointError: no complete checkpoint.
    """
    import contextlib
    import sys
    import tempfile

    from transformers import AutoTokenizer

    from zeropipe.checkpoint.consolidate import consolidated_state_dict, load_checked
    from zeropipe.checkpoint.manager import resolve_checkpoint
    from zeropipe.errors import ZeroPipeError
    from zeropipe.families.causal_lm.model import causal_lm_for_export

    source = Path(source)
    root = source.parent.parent if source.parent.name == "checkpoints" else source
    run_path, info = resolve_checkpoint(root / "checkpoints" / checkpoint if checkpoint else source)
    run = RunDir(run_path)
    config = run.read_config()
    settings = PreferenceSettings.of(config.preference)
    if config.model.family not in ("auto", "causal_lm"):
        # config.yaml records the family that trained it: a vision-language run's pairs hold images this reader does not take.
        raise ZeroPipeError(f"{run.path} is a {config.model.family} preference run: zeropipe eval scores causal LMs' pairs only, so far; its training metrics (rewards_accuracy, rewards_margin) are in metrics.jsonl")
    if settings.uses_reference and config.model.lora is None and not config.model.path:
        raise ZeroPipeError(f"{run.path} fine-tuned all the weights of a model built from model.config: its reference (the random start) is gone; evaluate a LoRA run or one from model.path")
    tokenizer = AutoTokenizer.from_pretrained(str(run.tokenizer))
    pad = pad_token_id(tokenizer)
    model = causal_lm_for_export(config, pad_token_id=pad if settings.method == "reward" else None)
    with contextlib.redirect_stdout(sys.stderr):  # zero_to_fp32's progress: stdout is the result's
        load_checked(model, consolidated_state_dict(info), info)
    model.eval()
    reference = None  # a LoRA run's reference is its base: the adapters disabled
    if settings.uses_reference and config.model.lora is None:
        reference = causal_lm_for_export(config).eval()  # model.path's weights, as training started from them
    batch_size = batch_size or run.read_plan().micro_batch_size
    with tempfile.TemporaryDirectory(prefix="zeropipe-eval-") as scratch:
        built = build_pair_cache(iter_records(Path(data).expanduser(), config.data.columns), tokenizer, Path(scratch), PAIRED, config.data.max_seq_len, config.data.max_bad_fraction)
        dataset = PairDataset(Path(scratch))
        correct, margins = 0, 0.0
        with torch.no_grad():
            for start in range(0, len(dataset), batch_size):
                batch = collate_pairs([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))], pad)
                inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
                if settings.method == "reward":
                    chosen, rejected = model(**inputs).logits.float().reshape(-1).chunk(2)
                else:
                    logps, _, mask = sequence_logps(model(**inputs).logits, batch)
                    if settings.method in ("orpo", "simpo"):
                        logps = logps / mask.sum(-1)
                    if settings.uses_reference:
                        if reference is not None:
                            ref = sequence_logps(reference(**inputs).logits, batch)[0]
                        else:
                            with model.disable_adapter():
                                ref = sequence_logps(model(**inputs).logits, batch)[0]
                        logps = logps - ref
                    chosen, rejected = (settings.beta * logps).chunk(2)
                correct += int((chosen > rejected).sum())
                margins += float((chosen - rejected).sum())
    pairs = built.examples
    return {"preference_accuracy": correct / pairs, "reward_margin": margins / pairs, "pairs": pairs, "method": settings.method,
            "run": str(run.path), "checkpoint": info.tag, "step": info.step, "data": str(Path(data).expanduser())}
