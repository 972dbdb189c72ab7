"""A tokenizer trained once for the data tests, on the kind of text they use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from zeropipe.data.tokenizer import train_tokenizer

TRAINING_TEXT = [
    "What is 3 + 5? 8. Reverse the word: cat tac",
    "Summarize the text below. The quick brown fox jumps over the lazy dog.",
    "Hello, how are you? I am fine, thank you! Plain ASCII with  double spaces.",
    "Instruction, context, response, system prompt: be brief. Paris is the capital of France.",
] * 20


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(TRAINING_TEXT, vocab_size=400, out_dir=out_dir)
    return out_dir


@pytest.fixture
def tokenizer(tokenizer_dir):
    """A fresh copy per test, so a test that sets a chat_template cannot leak it."""
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture
def write_jsonl():
    """Write records to a .jsonl file: dicts are dumped, strings written as they are (for broken lines)."""

    def write(path: Path, lines: list) -> Path:
        path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
        return path

    return write
