"""Small synthetic datasets a tiny model learns visibly within a few hundred CPU steps.

They let a new user (and the integration tests) see the whole pipeline work, loss going
down and generations getting right, without downloading anything.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Iterator
from pathlib import Path

from zeropipe.errors import DataError

TASKS = ("arithmetic", "reverse", "mixed")

ARITHMETIC_QUESTION = "What is {a} {op} {b}?"
REVERSE_QUESTION = "Reverse the word: {word}"


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise DataError(f"unknown synthetic task '{task}': choose one of {', '.join(TASKS)}.")


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    # Single-digit operands keep the problem space small (200 questions) so a tiny model
    # can get them right, while negative and two-digit answers still need more than copying.
    a, b, op = rng.randint(0, 9), rng.randint(0, 9), rng.choice("+-")
    answer = a + b if op == "+" else a - b
    return ARITHMETIC_QUESTION.format(a=a, op=op, b=b), str(answer)


def _reverse(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 5)))
    return REVERSE_QUESTION.format(word=word), word[::-1]


def _pairs(task: str, count: int, rng: random.Random) -> Iterator[tuple[str, str]]:
    """The records one at a time (a file of any size is written without holding it in memory)."""
    if task == "arithmetic":
        return (_arithmetic(rng) for _ in range(count))
    if task == "reverse":
        return (_reverse(rng) for _ in range(count))
    # Exactly half of each, interleaved at random so every batch sees both: one byte per record
    # (0 arithmetic, 1 reverse), shuffled as the list of makers was (the same order, the same file).
    kinds = bytearray(count // 2) + bytearray(b"\x01") * (count - count // 2)
    rng.shuffle(kinds)
    makers = (_arithmetic, _reverse)
    return (makers[kind](rng) for kind in kinds)


def generate_dataset(task: str, examples: int, seed: int, path: Path) -> Path:
    """Write ``examples`` Alpaca-format records for ``task`` to the JSONL file ``path``; same seed, same file.

    Records are streamed to the file (memory does not grow with ``examples``; the schema bounds it).

    Raises:
        DataError: unknown task or fewer than one example.
    """
    _check_task(task)
    if examples < 1:
        raise DataError(f"synthetic data needs at least 1 example (you asked for {examples}).")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as handle:
        for instruction, output in _pairs(task, examples, rng):
            handle.write(json.dumps({"instruction": instruction, "input": "", "output": output}) + "\n")
    return path


def sample_prompts(task: str, n: int, seed: int) -> list[str]:
    """``n`` instructions to show generations for, drawn apart from the training data's random stream."""
    _check_task(task)
    # A string seed is hashed with SHA-512, so it is stable across runs and far from the
    # integer seed the training file used.
    rng = random.Random(f"zeropipe-sample-prompts-{task}-{seed}")
    if task == "mixed":
        makers = [_arithmetic, _reverse]
        return [makers[index % 2](rng)[0] for index in range(n)]
    return [instruction for instruction, _ in _pairs(task, n, rng)]


def expected_answer(instruction: str) -> str | None:
    """The right output for a synthetic instruction, or None if it is not one of ours."""
    arithmetic = re.fullmatch(r"What is (\d) ([+-]) (\d)\?", instruction)
    if arithmetic:
        a, op, b = int(arithmetic[1]), arithmetic[2], int(arithmetic[3])
        return str(a + b if op == "+" else a - b)
    reverse = re.fullmatch(r"Reverse the word: ([a-z]+)", instruction)
    if reverse:
        return reverse[1][::-1]
    return None
