"""The tokenizer trained for from-scratch models."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from zeropipe.data.tokenizer import SPECIAL_TOKENS, texts_for_tokenizer, train_tokenizer
from zeropipe.errors import DataError


def test_saved_tokenizer_loads_back_and_round_trips(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    texts = ["What is 12 + 345?", "  two  spaces, then punctuation ! ?", "Unseen words: zebra quokka.", "ünïcode ✓"]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_tokens(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    for token in SPECIAL_TOKENS:
        assert tokenizer.convert_tokens_to_ids(token) != tokenizer.unk_token_id
        assert tokenizer.convert_ids_to_tokens(tokenizer(token, add_special_tokens=False)["input_ids"]) == [token]
    text = tokenizer("<|user|>\nHi\n<|assistant|>\nHello<|eos|>", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(text, skip_special_tokens=True) == "\nHi\n\nHello"


def test_digits_are_split_one_by_one(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokens = tokenizer.convert_ids_to_tokens(tokenizer("8 + 345 = 353", add_special_tokens=False)["input_ids"])
    digit_tokens = [token for token in tokens if any(character.isdigit() for character in token)]
    assert digit_tokens == ["8", "3", "4", "5", "3", "5", "3"]


def test_vocab_size_is_respected(tmp_path):
    texts = ["the cat sat on the mat with another cat"] * 50
    tokenizer = train_tokenizer(texts, vocab_size=270, out_dir=tmp_path)
    assert len(tokenizer) <= 270
    with pytest.raises(DataError, match="at least 262"):
        train_tokenizer(texts, vocab_size=100, out_dir=tmp_path)


def test_texts_for_tokenizer_yields_every_message():
    records = [
        {"instruction": "Add", "input": "2 and 3", "output": "5"},
        {"instruction": "broken"},
        {"instruction": "Hi", "output": "Hello"},
    ]
    assert list(texts_for_tokenizer(records, "alpaca")) == ["Add\n\n2 and 3", "5", "Hi", "Hello"]
    assert list(texts_for_tokenizer(["doc one", {"text": "doc two"}], "text")) == ["doc one", "doc two"]
