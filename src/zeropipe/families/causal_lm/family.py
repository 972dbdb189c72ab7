"""Causal language models (Llama, Qwen, Gemma, Mistral...) through transformers' Auto classes.

The fallback family: a model that no other family claims is a causal LM. Its data is
tokenized once by the launcher (``prepare.py``), its rank task is
:class:`~zeropipe.families.causal_lm.task.CausalLMTask`, it exports a transformers directory or a
peft adapter (``model.py``), and ``zeropipe generate`` answers prompts with it (``generate.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from zeropipe.config.schema import ModelSection, RunConfig
from zeropipe.data.mixture import mixture_note
from zeropipe.data.synthetic import sample_prompts
from zeropipe.data.token_cache import describe_cache
from zeropipe.errors import ConfigError
from zeropipe.export.hf import ExportJob, write_transformers_export
from zeropipe.families.causal_lm import generate as text_generation
from zeropipe.families.causal_lm.model import causal_lm_for_export, is_reward_model, trained_weights
from zeropipe.families.causal_lm.preference import PreferenceTask, preference_problems, prepare_preference_data
from zeropipe.families.causal_lm.prepare import prepare_cache, prepare_data_file, prepare_eval_cache, prepare_packs, prepare_tokenizer
from zeropipe.families.causal_lm.rl import GRPOTask, grpo_problems, prepare_grpo_data
from zeropipe.families.causal_lm.spec import causal_lm_config_spec
from zeropipe.families.causal_lm.task import CausalLMTask
from zeropipe.models.common import hidden_size_of, model_config
from zeropipe.models.moe import configure_moe
from zeropipe.rundir import PreparedData, RunDir


class CausalLM:
    name = "causal_lm"
    trains_tokenizer = True
    resumes_on_other_rank_counts = True  # its batches count the data for all ranks together (engine.task.SamplerBatches)
    answers_prompts = True
    evaluates_loss = True
    takes_images = False
    streams_answers = True
    sequence_parallel_refusal = None  # its task splits each micro-batch over the group (sequence_parallel.py)
    tiles_its_loss = True  # parallel.tiled_loss: supervised fine-tuning's next-token loss (tiled_loss.py)

    def detect(self, section: ModelSection) -> bool:
        return True  # what no other family claims

    def detect_dir(self, path: Path) -> bool:
        return (Path(path) / "config.json").is_file()

    def config_problems(self, config: RunConfig) -> list[tuple[str, str]]:
        return preference_problems(config) + grpo_problems(config)

    def curriculum_problems(self, config: RunConfig) -> list[tuple[str, str]]:
        return []

    def hidden_size(self, config: RunConfig) -> int | None:
        return hidden_size_of(model_config(config.model))

    def prepare_data(self, config: RunConfig, run: RunDir, reuse: bool) -> PreparedData:
        """The records read, validated and tokenized into the run's token cache; the tokenizer fixes the vocabulary."""
        if config.preference is not None:
            return prepare_preference_data(config, run, reuse)
        if config.grpo is not None:
            return prepare_grpo_data(config, run, reuse)
        records_path = prepare_data_file(config, run)
        tokenizer = prepare_tokenizer(config, run, records_path, reuse=reuse)
        cache = prepare_cache(config, run, records_path, tokenizer, reuse=reuse)
        notes = []
        if config.data.mixture:
            notes += [note for note in [mixture_note(run.data)] if note]
        notes += describe_cache(cache, records_path, config.data.format)
        if cache.get("reused_from"):
            notes.append(f"token cache reused from {cache['reused_from']} (the same files, tokenizer, template, format and max_seq_len)")
        if cache.get("bad_records"):
            # A whole file skipped (line 0: it leads out of a UI run's folders) is named by its file alone.
            shown = ", ".join(" ".join(filter(None, [b.get("file"), f"{b.get('unit', 'line')} {b['line']}" if b["line"] else ""])) + f": {b['reason']}" for b in cache["bad_records"][:3])
            notes.append(f"skipped {cache.get('bad_record_count', len(cache['bad_records']))} malformed record(s) in {records_path} ({shown})")
        if config.model.config is not None and config.model.config.get("vocab_size") in (None, "auto"):
            config.model.config = {**config.model.config, "vocab_size": len(tokenizer)}
            notes.append(f"model.config.vocab_size = {len(tokenizer)} (from the tokenizer)")
        hf_config = model_config(config.model)
        notes += configure_moe(hf_config, config.model.router_aux_loss_coef, config.model.experts_implementation)
        if getattr(hf_config, "vocab_size", None) is not None and len(tokenizer) > hf_config.vocab_size:
            raise ConfigError([("model.config.vocab_size", f"{hf_config.vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens: raise it or remove it")])
        examples = int(cache["examples"])
        notes += prepare_eval_cache(config, run, records_path, tokenizer, reuse=reuse)
        # What the sampler deals out: examples, or packed sequences of several examples.
        units = examples
        if config.data.packing:
            packs = prepare_packs(config, run, reuse=reuse)
            units = int(packs["packs"])
            notes.append(
                f"packing: {examples} examples in {units} sequences of up to {config.data.max_seq_len} tokens ({100 * packs['fill']:.0f}% real tokens); "
                "train.micro_batch_size counts packed sequences"
            )
        prompts = list(config.generate.prompts or [])
        if config.generate.prompts is None and config.data.synthetic is not None:
            prompts = sample_prompts(config.data.synthetic.task, 4, seed=config.data.synthetic.seed + 1)
        return PreparedData(
            examples=examples,
            hidden_size=hidden_size_of(hf_config),
            micro_batches_per_epoch=lambda micro, world_size: (units // world_size) // micro,
            prompts=prompts,
            notes=notes,
        )

    def rank_task(self, trainer) -> CausalLMTask:
        # Preference tuning and GRPO are other tasks on the same model: another loss, data and reference, the same loop.
        if trainer.config.grpo is not None:
            return GRPOTask(trainer)
        return PreferenceTask(trainer) if trainer.config.preference is not None else CausalLMTask(trainer)

    def model_spec(self, config: RunConfig):
        return causal_lm_config_spec(config)

    def export(self, job: ExportJob) -> Path:
        pad_id = None
        if is_reward_model(job.config):
            from transformers import AutoTokenizer

            pad_id = AutoTokenizer.from_pretrained(str(job.run.tokenizer)).pad_token_id
        model = causal_lm_for_export(job.config, pad_token_id=pad_id)
        return write_transformers_export(job, model, trained_weights(model, job.config.model, job.state_dict()))

    def load_for_generate(self, source, device: torch.device, dtype: torch.dtype):
        return text_generation.load_causal_lm(source, device, dtype)

    def generate(self, loaded, prompts, images, tokens, temperature, top_p, seed, raw, streamer=None):
        return text_generation.generate_text(loaded, prompts, images, tokens, temperature, top_p, seed, raw, streamer)


FAMILY = CausalLM()
