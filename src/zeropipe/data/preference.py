"""Preference records: their layouts, their tokenization as TRL does it, and the memory-mapped pair cache.

Layouts read (one record each):

- TRL's paired layout, ``prompt`` / ``chosen`` / ``rejected``: plain strings, or conversations
  (lists of ``{"role", "content"}``); without ``prompt``, the conversations' shared first turns
  are the prompt (TRL's ``extract_prompt``);
- TRL's unpaired layout (KTO), ``prompt`` / ``completion`` / ``label``;
- LLaMA-Factory's ``ranking: true`` datasets: alpaca style (``instruction``, ``input``,
  ``system``, with ``chosen`` / ``rejected`` answers) and sharegpt style (``conversations`` in
  ``from``/``value`` turns, ``chosen`` / ``rejected`` one turn each);
- axolotl's DPO types for the common datasets: ``chatml.intel`` (``system``, ``question``,
  ``chosen``, ``rejected``), ``chatml.argilla`` (``instruction``, ``chosen_response``,
  ``rejected_response``), ``chatml.ultra`` / ``llama3.ultra`` (TRL's conversational layout) and
  ``bradley_terry.chat_template`` for reward models (``system``, ``input``, ``chosen``, ``rejected``).

Tokenization follows TRL's DPO/KTO trainers (``trl.trainer.dpo_trainer._prepare_dataset``): a
plain prompt and prompt + completion + EOS are tokenized as text, a conversation through the
chat template (or ZeRO-Pipe's built-in template without one, as supervised fine-tuning renders
it), and the completion starts where the two tokenizations part. A pair longer than
``max_seq_len`` loses the start of its prompt first, then the end of its completions; both are
counted and reported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from zeropipe.data.formats import RecordError
from zeropipe.data.tokenize import render_example, render_prompt

PAIRED, UNPAIRED = "paired", "unpaired"
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system", "model": "assistant"}


def _message(turn: Any) -> dict[str, str]:
    if isinstance(turn, dict) and "role" in turn and "content" in turn:
        return {"role": str(turn["role"]), "content": str(turn["content"])}
    if isinstance(turn, dict) and "from" in turn and "value" in turn:
        role = SHAREGPT_ROLES.get(str(turn["from"]))
        if role is None:
            raise RecordError(f"unknown sharegpt speaker {turn['from']!r}")
        return {"role": role, "content": str(turn["value"])}
    raise RecordError(f"a turn must be {{role, content}} or {{from, value}}, got {str(turn)[:80]!r}")


def _conversation(value: Any) -> list[dict[str, str]]:
    if isinstance(value, dict):
        return [_message(value)]
    if isinstance(value, list) and value:
        return [_message(turn) for turn in value]
    raise RecordError("a conversation must be a non-empty list of turns")


def _answer(value: Any) -> list[dict[str, str]]:
    """A chosen or rejected answer of a conversational record: a string, one turn or a list of turns."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    return _conversation(value)


def _user_prompt(system: Any, text: str) -> list[dict[str, str]]:
    return ([{"role": "system", "content": str(system)}] if system else []) + [{"role": "user", "content": text}]


def normalize_record(record: dict[str, Any]) -> dict[str, Any]:
    """One record as TRL's layout: ``prompt`` with ``chosen``/``rejected`` (paired) or ``completion``/``label`` (unpaired).

    Strings stay strings (TRL's standard layout); every other layout becomes conversations.

    Raises:
        RecordError: a record of no known preference layout, naming the keys it has.
    """
    if not isinstance(record, dict):
        raise RecordError("a preference record must be an object")
    keys = set(record)
    if {"completion", "label"} <= keys:
        prompt, completion = record.get("prompt", ""), record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return {"prompt": prompt, "completion": completion, "label": bool(record["label"])}
        return {"prompt": _conversation(prompt), "completion": _answer(completion), "label": bool(record["label"])}
    turns_key = "messages" if "messages" in keys else "conversations" if "conversations" in keys else None
    if "label" in keys and turns_key and not {"chosen", "rejected"} & keys:  # LLaMA-Factory's KTO data: the last turn is the completion
        turns = _conversation(record[turns_key])
        if len(turns) < 2 or turns[-1]["role"] != "assistant":
            raise RecordError(f"a KTO record's {turns_key} must end with the assistant turn it labels")
        return {"prompt": turns[:-1], "completion": turns[-1:], "label": bool(record["label"])}
    if {"chosen_response", "rejected_response"} <= keys:  # axolotl chatml.argilla
        prompt = _user_prompt(record.get("system"), str(record.get("instruction", record.get("prompt", ""))))
        return {"prompt": prompt, "chosen": _answer(record["chosen_response"]), "rejected": _answer(record["rejected_response"])}
    if not {"chosen", "rejected"} <= keys:
        raise RecordError(
            f"no preference layout fits keys {sorted(keys)}: use prompt/chosen/rejected (TRL), prompt/completion/label (KTO), "
            "instruction/input/chosen/rejected (LLaMA-Factory alpaca ranking) or conversations/chosen/rejected (sharegpt ranking), "
            "or map your columns with data.columns"
        )
    chosen, rejected = record["chosen"], record["rejected"]
    if "conversations" in keys:  # LLaMA-Factory sharegpt ranking
        return {"prompt": _conversation(record["conversations"]), "chosen": _answer(chosen), "rejected": _answer(rejected)}
    if "instruction" in keys or "question" in keys or ("input" in keys and "prompt" not in keys):
        # LLaMA-Factory alpaca ranking, axolotl chatml.intel; input alone: axolotl's bradley_terry.chat_template
        # (system, input, chosen, rejected: argilla/distilabel-intel-orca-dpo-pairs, its reward-model example's data).
        text = str(record.get("instruction", record.get("question", "")))
        if record.get("input"):
            text = f"{text}\n{record['input']}" if text else str(record["input"])  # LLaMA-Factory's alpaca converter joins them so
        return {"prompt": _user_prompt(record.get("system"), text), "chosen": _answer(chosen), "rejected": _answer(rejected)}
    implicit = isinstance(chosen, list) and chosen and isinstance(chosen[0], dict) and _message(chosen[0])["role"] != "assistant"
    if "prompt" in keys and not implicit:
        prompt = record["prompt"]
        if isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str):
            return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
        prompt = _user_prompt(None, prompt) if isinstance(prompt, str) else _conversation(prompt)
        return {"prompt": prompt, "chosen": _answer(chosen), "rejected": _answer(rejected)}
    if isinstance(chosen, list) and isinstance(rejected, list):  # implicit prompt: the shared first turns (TRL extract_prompt)
        chosen, rejected = _conversation(chosen), _conversation(rejected)
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        if shared == 0:
            raise RecordError("chosen and rejected share no first turns and there is no prompt")
        return {"prompt": chosen[:shared], "chosen": chosen[shared:], "rejected": rejected[shared:]}
    raise RecordError("chosen and rejected without a prompt must be conversations (lists of turns)")


def unpair(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A paired record as KTO's two unpaired ones (TRL's unpair_preference_dataset); unpaired records as they are."""
    if "completion" in record:
        return [record]
    return [{"prompt": record["prompt"], "completion": record["chosen"], "label": True},
            {"prompt": record["prompt"], "completion": record["rejected"], "label": False}]


def common_prefix(ids: list[int], other: list[int]) -> int:
    """How many leading tokens two id lists share: where an answer starts after its prompt, as TRL finds it."""
    length = 0
    for token, other_token in zip(ids, other):
        if token != other_token:
            break
        length += 1
    return length


def _prompt_and_full(tokenizer: Any, prompt: Any, completion: Any) -> tuple[list[int], list[int]]:
    """(prompt ids, prompt + completion ids), as TRL tokenizes them."""
    if isinstance(prompt, str):
        text = completion if completion.endswith(tokenizer.eos_token) else completion + tokenizer.eos_token
        return tokenizer(prompt)["input_ids"], tokenizer(prompt + text)["input_ids"]
    if getattr(tokenizer, "chat_template", None):
        prompt_ids = tokenizer.apply_chat_template(prompt, tokenize=True, return_dict=True, add_generation_prompt=True)["input_ids"]
        full_ids = tokenizer.apply_chat_template(prompt + completion, tokenize=True, return_dict=True)["input_ids"]
        return list(prompt_ids), list(full_ids)
    # No chat template: ZeRO-Pipe's built-in one, rendered exactly as supervised fine-tuning renders it.
    return render_prompt(tokenizer, prompt), render_example(tokenizer, prompt + completion)[0]


@dataclass
class Tokenized:
    prompt: list[int]
    completions: list[list[int]]  # chosen, rejected (paired) or the one completion (unpaired)
    label: bool = True
    prompt_truncated: bool = False
    completion_truncated: bool = False


def tokenize_record(tokenizer: Any, record: dict[str, Any], max_seq_len: int) -> Tokenized:
    """A normalized record's token ids: the prompt and its completions, cut to ``max_seq_len`` prompt first."""
    answers = [record["chosen"], record["rejected"]] if "chosen" in record else [record["completion"]]
    pairs = [_prompt_and_full(tokenizer, record["prompt"], answer) for answer in answers]
    prompt_ids = pairs[0][0]
    # The completion starts where prompt and prompt + completion part (TRL's common_prefix_length).
    prompt_len = min(common_prefix(prompt_ids, full) for _, full in pairs)
    prompt = list(prompt_ids[:prompt_len])
    completions = [list(full[prompt_len:]) for _, full in pairs]
    if not all(completions):
        raise RecordError("a completion is empty once tokenized")
    result = Tokenized(prompt, completions, bool(record.get("label", True)))
    overflow = len(prompt) + max(len(c) for c in completions) - max_seq_len
    if overflow > 0:
        # The prompt's start goes first (its end leads into the answer), down to half the length.
        keep = min(len(prompt), max(max_seq_len // 2, len(prompt) - overflow))
        if keep < len(prompt):
            result.prompt = prompt[len(prompt) - keep :]
            result.prompt_truncated = True
        room = max_seq_len - len(result.prompt)
        if any(len(c) > room for c in completions):
            result.completions = [c[:room] for c in completions]
            result.completion_truncated = True
    return result


# ----------------------------------------------------------------------------- the cache
@dataclass
class PairCacheInfo:
    kind: str  # paired or unpaired
    examples: int = 0
    bad_records: list[dict] = field(default_factory=list)
    bad_record_count: int = 0
    prompts_truncated: int = 0
    completions_truncated: int = 0
    desirable: int = 0
    undesirable: int = 0


def build_pair_cache(records: Iterator[Any], tokenizer: Any, out_dir: Path, kind: str, max_seq_len: int, max_bad_fraction: float) -> PairCacheInfo:
    """Tokenize preference records into ``out_dir``: ``tokens.npy`` (all ids, flat) and ``rows.npy`` (one row per example).

    A paired row is (start, prompt, chosen, rejected lengths); an unpaired one (start, prompt,
    completion lengths, label). Records arrive as ``data.records.Record`` / ``BadRecord``.

    Raises:
        DataError: more malformed records than ``max_bad_fraction`` allows.
    """
    from zeropipe.data.records import BadRecord
    from zeropipe.errors import DataError

    from zeropipe.data.token_cache import _NpyAppender

    out_dir.mkdir(parents=True, exist_ok=True)
    # Tokens go to disk as they come (the launcher never holds the dataset); a row is 4 numbers per example.
    appender = _NpyAppender(out_dir / "tokens.npy", np.dtype(np.uint32))
    pending: list[int] = []
    written = 0
    rows: list[tuple[int, int, int, int]] = []
    info = PairCacheInfo(kind)
    seen = 0
    for item in records:
        seen += 1
        if isinstance(item, BadRecord):
            info.bad_record_count += 1
            if len(info.bad_records) < 20:
                info.bad_records.append(item.to_json())
            continue
        try:
            normalized = normalize_record(item.value)
            units = unpair(normalized) if kind == UNPAIRED else [normalized]
            if kind == PAIRED and "completion" in normalized:
                raise RecordError("an unpaired record (prompt/completion/label) in a paired method's data: use preference.method kto")
            done = [tokenize_record(tokenizer, unit, max_seq_len) for unit in units]
        except RecordError as error:
            info.bad_record_count += 1
            if len(info.bad_records) < 20:
                info.bad_records.append(item.bad(str(error)).to_json())
            continue
        for unit in done:
            start = written + len(pending)
            pending += unit.prompt
            for completion in unit.completions:
                pending += completion
            if kind == PAIRED:
                rows.append((start, len(unit.prompt), len(unit.completions[0]), len(unit.completions[1])))
            else:
                rows.append((start, len(unit.prompt), len(unit.completions[0]), int(unit.label)))
                info.desirable += int(unit.label)
                info.undesirable += int(not unit.label)
            info.prompts_truncated += unit.prompt_truncated
            info.completions_truncated += unit.completion_truncated
            info.examples += 1
        if len(pending) >= 1 << 20:
            appender.append(np.asarray(pending, dtype=np.uint32))
            written += len(pending)
            pending = []
    appender.append(np.asarray(pending, dtype=np.uint32))
    if seen and info.bad_record_count > max_bad_fraction * seen:
        shown = "; ".join(f"{b.get('file', '')} line {b.get('line')}: {b.get('reason')}" for b in info.bad_records[:3])
        appender.close()
        raise DataError(f"{info.bad_record_count} of {seen} preference records are malformed ({shown}): fix them or raise data.max_bad_fraction")
    if not info.examples:
        appender.close()
        raise DataError("no usable preference records: each needs prompt/chosen/rejected (or prompt/completion/label for kto)")
    appender.finish()
    np.save(out_dir / "rows.npy", np.asarray(rows, dtype=np.int64).reshape(-1, 4))
    (out_dir / "pairs.json").write_text(json.dumps(info.__dict__))
    return info


def read_pair_info(cache_dir: Path) -> dict[str, Any] | None:
    path = Path(cache_dir) / "pairs.json"
    return json.loads(path.read_text()) if path.is_file() else None


class PairDataset(torch.utils.data.Dataset):
    """The pair cache, memory-mapped; an item is its index, prompt ids and completion ids (and KTO's label)."""

    def __init__(self, cache_dir: Path):
        self.cache_dir = Path(cache_dir)
        self.tokens = np.load(self.cache_dir / "tokens.npy", mmap_mode="r")
        self.rows = np.load(self.cache_dir / "rows.npy")
        self.kind = json.loads((self.cache_dir / "pairs.json").read_text())["kind"]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        start, prompt, first, last = (int(v) for v in self.rows[index])
        ids = self.tokens[start : start + prompt + first + (last if self.kind == PAIRED else 0)].astype(np.int64).tolist()
        item = {"index": index, "prompt": ids[:prompt], "chosen": ids[prompt : prompt + first]}
        if self.kind == PAIRED:
            item["rejected"] = ids[prompt + first :]
        else:
            item["label"] = bool(last)
            # KTO's KL row: this prompt with the previous example's completion, fixed per example (TRL pairs them
            # once, when it maps the dataset), so a precomputed reference covers it.
            other_start, other_prompt, other_length, _ = (int(v) for v in self.rows[index - 1])
            item["kl"] = self.tokens[other_start + other_prompt : other_start + other_prompt + other_length].astype(np.int64).tolist()
        return item

    def lengths(self) -> np.ndarray:
        return self.rows[:, 1] + self.rows[:, 2] + (self.rows[:, 3] if self.kind == PAIRED else 0)


def preference_texts(records: Iterator[Any]) -> Iterator[str]:
    """Every prompt and answer text of the records, for training a tokenizer; malformed records are skipped here."""
    from zeropipe.data.records import Record

    for item in records:
        if not isinstance(item, Record):
            continue
        try:
            record = normalize_record(item.value)
        except RecordError:
            continue
        for key in ("prompt", "chosen", "rejected", "completion"):
            value = record.get(key)
            if isinstance(value, str):
                yield value
            elif isinstance(value, list):
                yield from (message["content"] for message in value)


def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(row) for row in rows)
    return torch.tensor([row + [value] * (width - len(row)) for row in rows], dtype=torch.long)


def _sequences(prompts: list[list[int]], completions: list[list[int]], pad_id: int, prefix: str = "") -> dict[str, torch.Tensor]:
    full = [p + c for p, c in zip(prompts, completions)]
    return {
        f"{prefix}input_ids": _pad(full, pad_id),
        f"{prefix}attention_mask": _pad([[1] * len(row) for row in full], 0),
        f"{prefix}completion_mask": _pad([[0] * len(p) + [1] * len(c) for p, c in zip(prompts, completions)], 0),
    }


def collate_pairs(items: list[dict[str, Any]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Chosen rows then rejected rows, right-padded (TRL's DataCollatorForPreference layout), with each pair's index."""
    prompts = [item["prompt"] for item in items]
    batch = _sequences(prompts + prompts, [item["chosen"] for item in items] + [item["rejected"] for item in items], pad_token_id)
    batch["index"] = torch.tensor([item["index"] for item in items], dtype=torch.long)
    return batch


def collate_unpaired(items: list[dict[str, Any]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """KTO's rows and its KL rows: each prompt with another example's completion.

    An item's ``kl`` completion is used where the dataset gives one (``PairDataset``: the previous
    example's); otherwise the batch's completions are rotated by one, as TRL does within a batch.
    """
    prompts = [item["prompt"] for item in items]
    completions = [item["chosen"] for item in items]
    batch = _sequences(prompts, completions, pad_token_id)
    others = [item["kl"] for item in items] if all("kl" in item for item in items) else [completions[-1]] + completions[:-1]
    batch.update(_sequences(prompts, others, pad_token_id, prefix="KL_"))
    batch["label"] = torch.tensor([item["label"] for item in items], dtype=torch.bool)
    batch["index"] = torch.tensor([item["index"] for item in items], dtype=torch.long)
    return batch
