"""Training a small byte-level BPE tokenizer for models built from scratch."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from zeropipe.data.formats import RecordError, to_conversation
from zeropipe.errors import DataError

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
# The built-in chat template's markers (see zeropipe.data.tokenize), one token each.
ROLE_TOKENS = ("<|user|>", "<|assistant|>", "<|system|>")
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, *ROLE_TOKENS)
BYTE_ALPHABET_SIZE = 256


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts``, save it to ``out_dir`` and return it.

    Raises:
        DataError: ``vocab_size`` cannot hold the 256 byte tokens and the special tokens.
    """
    smallest = BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)
    if vocab_size < smallest:
        raise DataError(
            f"tokenizer vocab_size {vocab_size} is too small: byte-level BPE needs {BYTE_ALPHABET_SIZE} byte "
            f"tokens plus {len(SPECIAL_TOKENS)} special tokens. Set it to at least {smallest}."
        )
    tokenizer = Tokenizer(models.BPE())
    # Byte-level so any string can be encoded; digits split one by one first, because a
    # number merged into arbitrary chunks ("12", "345") hides the place values arithmetic needs.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        # transformers 5 renames this extra_special_tokens and converts the old name; 4.x
        # only knows this one (its extra_special_tokens is a different, named mapping).
        additional_special_tokens=list(ROLE_TOKENS),
        # Byte-level decoding is exact already; the clean-up would drop spaces before punctuation.
        clean_up_tokenization_spaces=False,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(out_dir)
    return wrapped


def texts_for_tokenizer(records: Iterable[dict | str], fmt: str) -> Iterator[str]:
    """Every message content (or text) of the records; records that do not fit ``fmt`` are skipped."""
    for record in records:
        try:
            content = to_conversation(record, fmt)
        except RecordError:
            continue  # build_token_cache reports malformed records; here they only would add noise
        if isinstance(content, str):
            yield content
        else:
            for message in content:
                yield message["content"]
