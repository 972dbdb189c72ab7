"""Issue 46, defect 12: Sample-now answers of a language-model run were overwritten by the end-of-run answers
(``write_generations`` opened RUN/generations.jsonl with "w"); each step's answers are kept, a step written again replaced."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch


def test_answers_of_earlier_steps_are_kept_and_a_step_written_again_is_replaced(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from zeropipe.data.tokenizer import train_tokenizer
    from zeropipe.engine.task import write_generations

    tokenizer = train_tokenizer([f"What is {a} + 1? {a + 1}" for a in range(20)], 280, tmp_path / "tok")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    path = tmp_path / "generations.jsonl"
    trainer = SimpleNamespace(engine=SimpleNamespace(module=model), config=SimpleNamespace(generate=SimpleNamespace(max_new_tokens=3)),
                              plan=SimpleNamespace(zero_stage=2), world_size=1, rank=0, run=SimpleNamespace(generations=path), step=0)  # fmt: skip
    inputs = [({"input_ids": torch.tensor([tokenizer("What is 1 + 1?")["input_ids"]])}, {"prompt": "What is 1 + 1?"})]
    for step in (5, 9, 12, 12):  # Sample now at 5 and 9, the end of the run at 12, and 12 again after a resume
        trainer.step = step
        write_generations(trainer, tokenizer, inputs)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [row["step"] for row in rows] == [5, 9, 12] and all(row["prompt"] == "What is 1 + 1?" and "output" in row for row in rows), rows
    assert model.training  # left training, as the step loop needs
