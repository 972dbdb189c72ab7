"""ZeRO-Pipe's GRPO objective equals TRL 1.16's GRPOTrainer, from the same prompts, completions and rewards.

Sampling differs between any two implementations, so the completions are injected: TRL's
``_generate`` (the step that samples) is replaced by one returning fixed token ids, as TRL's own
tests replace generation; everything after it is TRL's own code: the reward calls, the group
advantages and reward figures (``_generate_and_score_completions``), the reference's log-probs
and the loss and its figures (``_compute_loss``). The sampling policy's log-probs are injected
too, set apart from the current policy's so that the clip is in play. ZeRO-Pipe's side is
``engine.grpo`` on the same tiny fp32 model's logits. Every loss type TRL 1.16 lists is covered.
"""

from __future__ import annotations

import copy

import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402

from zeropipe.data.tokenizer import train_tokenizer  # noqa: E402
from zeropipe.engine.grpo import LOSS_TYPES, GRPOSettings, completion_figures, completion_logps, group_advantages, grpo_loss  # noqa: E402

PROMPTS = ["What is 2 + 3? ", "Name a colour of the sky: ", "Spell cat backwards: "]
GENERATIONS = 4
MAX_COMPLETION = 6
TOLERANCE = 1e-5


def reward_length(completions, **kwargs):
    return [float(len(text)) / 10 for text in completions]


def reward_vowels(completions, **kwargs):
    return [float(sum(text.count(v) for v in "aeiou")) for text in completions]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    texts = [p + " It is 5. blue tac 6 green with spots act" for p in PROMPTS] * 4
    return train_tokenizer(texts, 300, tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def models(tokenizer, tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    def build(seed):
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
        model = LlamaForCausalLM(config).float()
        with torch.no_grad():  # larger weights than the init: log-probs and rewards that differ visibly
            for parameter in model.parameters():
                parameter.mul_(4 if parameter.dim() > 1 else 1)
        return model

    reference_dir = tmp_path_factory.mktemp("reference")
    reference = build(1)
    reference.save_pretrained(reference_dir)
    policy = build(0)
    # TRL builds a full fine-tune's reference from the policy's model id: the saved reference here.
    policy.config._name_or_path = str(reference_dir)
    return policy, reference.eval()


def injected(tokenizer):
    """Prompt ids and G completions per prompt: some end in EOS, some run to max_completion_length (truncated)."""
    generator = torch.Generator().manual_seed(7)
    specials = set(tokenizer.all_special_ids)
    ordinary = [i for i in range(len(tokenizer)) if i not in specials]
    prompt_ids, completion_ids = [], []
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        for g in range(GENERATIONS):
            length = int(torch.randint(2, MAX_COMPLETION + 1, (1,), generator=generator))
            tokens = [ordinary[int(i)] for i in torch.randint(0, len(ordinary), (length,), generator=generator)]
            if g % 2 == 0 and length < MAX_COMPLETION:
                tokens[-1] = tokenizer.eos_token_id
            prompt_ids.append(list(ids))
            completion_ids.append(tokens)
    return prompt_ids, completion_ids


CASES = [
    ("grpo", {}), ("bnpo", {}), ("dr_grpo", {}), ("dapo", {}), ("cispo", {"epsilon_high": 1.2}), ("sapo", {}),
    ("luspo", {"importance_sampling_level": "sequence"}), ("vespo", {}),
    ("grpo", {"scale_rewards": "batch", "importance_sampling_level": "sequence", "beta": 0.0, "epsilon_high": 0.28, "delta": 1.3}),
    ("dapo", {"scale_rewards": "none", "mask_truncated_completions": True}),
]


@pytest.mark.parametrize("loss_type, extra", CASES, ids=[f"{case[0]}-{i}" for i, case in enumerate(CASES)])
def test_grpo_matches_trl(tokenizer, models, tmp_path, loss_type, extra):
    from trl import GRPOConfig, GRPOTrainer

    policy, reference = models
    options = {"beta": 0.05, "epsilon": 0.2, "temperature": 0.7, "reward_weights": [1.0, 0.5], **extra}
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=len(PROMPTS) * GENERATIONS, num_generations=GENERATIONS,
                      max_completion_length=MAX_COMPLETION, loss_type=loss_type, report_to=[], use_cpu=True, bf16=False, fp16=False, **options)
    trainer = GRPOTrainer(model=copy.deepcopy(policy), reward_funcs=[reward_length, reward_vowels], args=args,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]), processing_class=tokenizer)
    trainer.model.train()
    prompt_ids, completion_ids = injected(tokenizer)
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    trainer._generate = lambda prompts: (prompt_ids, completion_ids, None, texts, None, {}, None, None)
    inputs = [{"prompt": p} for p in PROMPTS for _ in range(GENERATIONS)]  # TRL's sampler repeats each prompt G times
    output = trainer._generate_and_score_completions(inputs)

    # ZeRO-Pipe's side, from the same ids.
    settings = GRPOSettings(loss_type=loss_type, num_generations=GENERATIONS, max_completion_length=MAX_COMPLETION,
                            **{k: (tuple(v) if k == "reward_weights" else v) for k, v in options.items()})
    pad = tokenizer.pad_token_id
    completions = torch.full((len(completion_ids), MAX_COMPLETION), pad)
    mask = torch.zeros_like(completions)
    for row, ids in enumerate(completion_ids):
        completions[row, : len(ids)] = torch.tensor(ids)
        mask[row, : len(ids)] = 1
    completions, mask = completions[:, : output["completion_ids"].shape[1]], mask[:, : output["completion_ids"].shape[1]]
    truncated = torch.tensor([ids[-1] not in (tokenizer.eos_token_id, pad) for ids in completion_ids])
    if settings.mask_truncated_completions:
        mask = mask * (~truncated).unsqueeze(1)
    assert torch.equal(completions, output["completion_ids"]) and torch.equal(mask, output["completion_mask"])
    width = max(len(ids) for ids in prompt_ids)  # prompts left-padded, as TRL (and generation) pads them
    prompts = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompt_ids])
    prompt_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids])
    assert torch.equal(prompts, output["prompt_ids"]) and torch.equal(prompt_mask, output["prompt_mask"])
    rewards = torch.tensor([[a, b] for a, b in zip(reward_length(texts), reward_vowels(texts), strict=True)])
    advantages, figures = group_advantages(settings, rewards, ["reward_length", "reward_vowels"])
    figures.update(completion_figures(torch.tensor([len(ids) for ids in completion_ids]), truncated))
    assert torch.allclose(advantages, output["advantages"], atol=TOLERANCE)

    def scored(model):
        ids = torch.cat([prompts, completions], dim=1)
        attention = torch.cat([prompt_mask, mask], dim=1)
        logits = model(input_ids=ids, attention_mask=attention).logits[:, prompts.shape[1] - 1 : -1]
        return completion_logps(logits, completions, settings.temperature)

    logps, entropies = scored(policy)
    with torch.no_grad():
        ref_logps = scored(reference)[0] if settings.beta else None
    old = logps.detach() + 0.3 * torch.sin(torch.arange(logps.numel()).reshape(logps.shape).float())  # a sampler that differs
    if settings.beta:
        assert torch.allclose(ref_logps * mask, output["ref_per_token_logps"] * mask, atol=TOLERANCE)  # TRL zeroes the padding
    output["old_per_token_logps"] = old
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train() at each step; one micro-batch per step here
    trl_loss = trainer._compute_loss(trainer.model, output)
    loss, loss_figures = grpo_loss(settings, logps, mask, advantages, entropies, old, ref_logps)
    figures.update(loss_figures)

    assert float(loss) == pytest.approx(float(trl_loss), abs=TOLERANCE)
    logged = {name: values[-1] for name, values in trainer._metrics["train"].items() if name != "num_tokens"}
    assert set(logged) <= set(figures), f"figures TRL logs that ZeRO-Pipe does not: {set(logged) - set(figures)}"
    for name, value in logged.items():
        assert float(figures[name]) == pytest.approx(value, abs=TOLERANCE), name
    if loss_type in ("grpo", "dapo") and not extra.get("delta"):
        assert float(figures["clip_ratio/region_mean"]) > 0  # the clip is in play, not a ratio of 1 everywhere


def test_every_trl_loss_type_is_covered():
    from trl import GRPOConfig

    help_text = GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    listed = {name for name in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo", "gspo", "ppo") if f"'{name}'" in help_text or f"`{name}`" in help_text}
    assert listed <= set(LOSS_TYPES) and {case[0] for case in CASES} == set(LOSS_TYPES)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_num_iterations_matches_trl(tokenizer, models, tmp_path, loss_type):
    """num_iterations 2: the sampling policy's log-probs are kept at generation (TRL's old_per_token_logps) and the second
    pass, after the weights moved, is clipped against them: both passes' losses and figures equal TRL's."""
    from trl import GRPOConfig, GRPOTrainer

    policy, reference = models
    policy = copy.deepcopy(policy)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=len(PROMPTS) * GENERATIONS, num_generations=GENERATIONS,
                      max_completion_length=MAX_COMPLETION, loss_type=loss_type, num_iterations=2, beta=0.05, epsilon=0.2, temperature=0.7,
                      report_to=[], use_cpu=True, bf16=False, fp16=False)
    trainer = GRPOTrainer(model=copy.deepcopy(policy), reward_funcs=[reward_length, reward_vowels], args=args,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]), processing_class=tokenizer)
    trainer.model.train()
    prompt_ids, completion_ids = injected(tokenizer)
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    trainer._generate = lambda prompts: (prompt_ids, completion_ids, None, texts, None, {}, None, None)
    output = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(GENERATIONS)])
    trainer.current_gradient_accumulation_steps = 1
    assert output.get("old_per_token_logps") is not None  # TRL keeps the sampling policy's log-probs for the later pass

    settings = GRPOSettings(loss_type=loss_type, num_generations=GENERATIONS, max_completion_length=MAX_COMPLETION, beta=0.05, epsilon=0.2, temperature=0.7)
    completions, mask = output["completion_ids"], output["completion_mask"]
    prompts, prompt_mask = output["prompt_ids"], output["prompt_mask"]
    rewards = torch.tensor([[a, b] for a, b in zip(reward_length(texts), reward_vowels(texts), strict=True)])
    advantages, _ = group_advantages(settings, rewards, ["reward_length", "reward_vowels"])

    def scored(model):
        ids = torch.cat([prompts, completions], dim=1)
        attention = torch.cat([prompt_mask, mask], dim=1)
        logits = model(input_ids=ids, attention_mask=attention).logits[:, prompts.shape[1] - 1 : -1]
        return completion_logps(logits, completions, settings.temperature)

    with torch.no_grad():  # what GRPOTask.generate_round keeps: the sampling policy's and the reference's log-probs
        old, ref_logps = scored(policy)[0], scored(reference)[0]
    assert torch.allclose(old * mask, output["old_per_token_logps"] * mask, atol=TOLERANCE)

    def move(model):  # the same update on both sides: the second pass trains a policy that moved since sampling
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator) * parameter.abs().mean())

    for iteration in range(2):
        if iteration == 1:
            move(policy)
            move(trainer.model)
        trl_loss = trainer._compute_loss(trainer.model, output)
        logps, entropies = scored(policy)
        loss, figures = grpo_loss(settings, logps, mask, advantages, entropies, old, ref_logps)
        assert float(loss) == pytest.approx(float(trl_loss), abs=TOLERANCE), iteration
        logged = {name: values[-1] for name, values in trainer._metrics["train"].items() if name in figures}
        assert {"kl", "clip_ratio/region_mean", "entropy"} <= set(logged)
        for name, value in logged.items():
            assert float(figures[name]) == pytest.approx(value, abs=TOLERANCE), (iteration, name)
        clipped = float(figures["clip_ratio/region_mean"])
        assert clipped == 0 if iteration == 0 else clipped > 0  # the first pass samples with these very weights; the second is clipped
