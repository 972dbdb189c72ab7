"""Turning records into token ids with loss masks; the memory-mapped token cache that holds them is ``data.token_cache``.

Labels are aligned with ``input_ids`` (the Hugging Face convention): the model shifts them
by one itself. ``IGNORE_INDEX`` marks tokens that carry no loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zeropipe.data.formats import RecordError
from zeropipe.errors import DataError

IGNORE_INDEX = -100

# The built-in template for tokenizers without a chat_template. The markers are special
# tokens in tokenizers made by zeropipe.data.tokenizer, so each is a single token.
PLAIN_SYSTEM = "<|system|>\n{content}\n"
PLAIN_USER = "<|user|>\n{content}\n"
PLAIN_ASSISTANT_PROMPT = "<|assistant|>\n"


@dataclass
class Segment:
    """A piece of an example, tokenized on its own so its boundaries are the same in
    training and in :func:`render_prompt`."""

    text: str = ""
    ids: list[int] = field(default_factory=list)  # for tokens given by id (bos, eos)
    has_loss: bool = False


def render_example(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids and labels for one conversation; only assistant turns carry loss."""
    segments = conversation_segments(tokenizer, messages, add_generation_prompt=False)
    texts = [segment.text for segment in segments]
    return _assemble(segments, _encode_texts(tokenizer, texts))


def pad_token_id(tokenizer: Any) -> int:
    """The id batches are padded with: the pad token, else EOS (padding is masked out of attention and loss)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def render_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Ids to generate the next assistant turn from, rendered exactly as in training."""
    segments = conversation_segments(tokenizer, messages, add_generation_prompt=True)
    ids, _ = _assemble(segments, _encode_texts(tokenizer, [segment.text for segment in segments]))
    return ids


def conversation_segments(tokenizer: Any, messages: list[dict], add_generation_prompt: bool) -> list[Segment]:
    if getattr(tokenizer, "chat_template", None):
        return _template_segments(tokenizer, messages, add_generation_prompt)
    return _plain_segments(tokenizer, messages, add_generation_prompt)


def _plain_segments(tokenizer: Any, messages: list[dict], add_generation_prompt: bool) -> list[Segment]:
    if tokenizer.eos_token_id is None:
        raise DataError(
            "the tokenizer has no eos token and no chat_template: the built-in template ends each assistant "
            "turn with eos so the model learns to stop. Use a tokenizer with an eos token or a chat_template."
        )
    segments = []
    if tokenizer.bos_token_id is not None:
        segments.append(Segment(ids=[tokenizer.bos_token_id]))
    # Everything between two assistant replies is one prompt segment, so the text the model
    # sees before a reply is tokenized the same way whether it is training or generating.
    prompt = ""
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "system":
            prompt += PLAIN_SYSTEM.format(content=content)
        elif role == "user":
            prompt += PLAIN_USER.format(content=content)
        elif role == "assistant":
            segments.append(Segment(text=prompt + PLAIN_ASSISTANT_PROMPT))
            segments.append(Segment(text=content, has_loss=True))
            segments.append(Segment(ids=[tokenizer.eos_token_id], has_loss=True))
            prompt = ""
        else:
            raise RecordError(f"unknown role '{role}'")
    if add_generation_prompt:
        prompt += PLAIN_ASSISTANT_PROMPT
    if prompt:
        segments.append(Segment(text=prompt))
    return segments


def _template_segments(tokenizer: Any, messages: list[dict], add_generation_prompt: bool) -> list[Segment]:
    """Split the chat-template rendering into prompt and assistant pieces.

    For each assistant turn, the rendering of the conversation up to it (with the
    generation prompt) and through it tell where the reply starts and ends, and the
    reply's end includes whatever the template closes a turn with (eos, <|im_end|>...).
    Bos is left to the template: chat templates write it themselves when the model wants it.
    """
    from jinja2 import TemplateError

    def render(turns: list[dict], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)

    try:
        full = render(messages, add_generation_prompt)
    except (TemplateError, ValueError) as error:
        # e.g. "Conversation roles must alternate user/assistant/user/assistant/..."
        raise RecordError(f"the tokenizer's chat_template rejected this conversation: {error}") from None
    segments = []
    cursor = 0
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        try:
            before = render(messages[:index], True)
            through = render(messages[: index + 1], False)
        except (TemplateError, ValueError):
            # An assistant turn the template cannot render on its own (say, the first
            # message) stays in the prompt without loss rather than losing the record.
            continue
        # Templates that re-render earlier turns differently (some drop past reasoning)
        # are not prefix-stable; such a turn stays in the prompt without loss.
        if cursor <= len(before) and through.startswith(before) and full.startswith(through):
            segments.append(Segment(text=full[cursor : len(before)]))
            segments.append(Segment(text=full[len(before) : len(through)], has_loss=True))
            cursor = len(through)
    if cursor < len(full):
        segments.append(Segment(text=full[cursor:]))
    return segments


def _encode_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids for each text, without the tokenizer adding bos/eos on its own."""
    wanted = [text for text in texts if text]
    encoded = iter(tokenizer(wanted, add_special_tokens=False)["input_ids"]) if wanted else iter(())
    return [next(encoded) if text else [] for text in texts]  # lists already: no copy


def _assemble(segments: list[Segment], encoded: list[list[int]]) -> tuple[list[int], list[int]]:
    input_ids: list[int] = []
    labels: list[int] = []
    for segment, text_ids in zip(segments, encoded):
        ids = segment.ids + text_ids
        input_ids += ids
        labels += ids if segment.has_loss else [IGNORE_INDEX] * len(ids)
    return input_ids, labels


def _text_chunks(tokenizer: Any, text_ids: list[int], max_seq_len: int) -> list[tuple[list[int], list[int]]]:
    if not text_ids:
        return [([], [])]  # an empty document teaches nothing; build_token_cache counts it as dropped
    ids = list(text_ids)
    if tokenizer.bos_token_id is not None:
        ids.insert(0, tokenizer.bos_token_id)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)  # marks where a document ends for the next one
    # Consecutive chunks overlap by one token: the first token of a chunk is never predicted
    # (nothing comes before it), so overlapping lets every token of the text be a target once.
    chunks = []
    start = 0
    while True:
        chunk = ids[start : start + max_seq_len]
        labels = list(chunk)
        if labels:
            labels[0] = IGNORE_INDEX
        chunks.append((chunk, labels))
        if start + max_seq_len >= len(ids):
            return chunks
        start += max_seq_len - 1


def tokenize_batch(
    tokenizer: Any, plans: list[list[Segment] | str], max_seq_len: int
) -> list[tuple[list[int], list[int], bool]]:
    """``(input_ids, labels, truncated)`` per example; a text record may give several chunks."""
    # One tokenizer call for the whole batch: the fast tokenizer runs it in parallel.
    texts: list[str] = []
    for plan in plans:
        texts += [plan] if isinstance(plan, str) else [segment.text for segment in plan]
    encoded = iter(_encode_texts(tokenizer, texts))

    examples = []
    for plan in plans:
        if isinstance(plan, str):
            for chunk, labels in _text_chunks(tokenizer, next(encoded), max_seq_len):
                examples.append((chunk, labels, False))
            continue
        input_ids, labels = _assemble(plan, [next(encoded) for _ in plan])
        was_truncated = len(input_ids) > max_seq_len
        input_ids, labels = input_ids[:max_seq_len], labels[:max_seq_len]
        if labels:
            labels[0] = IGNORE_INDEX  # never a target after the model's shift; keeps loss_tokens honest
        examples.append((input_ids, labels, was_truncated))
    return examples


