"""ZeRO-Pipe's preference losses equal TRL's trainers' (TRL pinned in the test extra), from the same raw records.

Both sides start from the same records and the same tiny fp32 model: TRL's trainer tokenizes,
collates and runs its own forward pass and ``compute_loss``; ZeRO-Pipe's path is
``data.preference`` (normalize, tokenize, collate) then the model and ``engine.preference``.
The loss and every reward figure must agree to 1e-5, for DPO (sigmoid on plain text;
IPO + the SFT mix on conversations), ORPO, SimPO, KTO (with its KL term) and the reward model.
"""

from __future__ import annotations

import copy

import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from tokenizers.processors import TemplateProcessing  # noqa: E402

from zeropipe.data.preference import collate_pairs, collate_unpaired, normalize_record, tokenize_record, unpair  # noqa: E402
from zeropipe.data.tokenizer import train_tokenizer  # noqa: E402
from zeropipe.engine.preference import PreferenceSettings, dpo_loss, kto_loss, policy_loss, reward_loss, sequence_logps  # noqa: E402

PLAIN = [
    {"prompt": "What is 2 + 3? ", "chosen": "It is 5.", "rejected": "It is 7, I think."},
    {"prompt": "Name a colour of the sky: ", "chosen": "blue", "rejected": "green with spots"},
    {"prompt": "Spell cat backwards: ", "chosen": "tac", "rejected": "act"},
    {"prompt": "What is 10 - 4? ", "chosen": "6", "rejected": "It must be 5 or so."},
]
# TRL's ORPO and CPO trainers move a prompt token merged with the answer's first into the answer;
# its DPO, KTO and reward trainers (and ZeRO-Pipe, for every method) cut where the two
# tokenizations part. The prompts above end in a space that merges; ending them with a newline
# (its own pre-token) makes the cut the same in both, so ORPO/SimPO compare the losses.
NEWLINE = [{**r, "prompt": r["prompt"].rstrip() + "\n"} for r in PLAIN]
CONVERSATIONS = [
    {"prompt": [{"role": "user", "content": r["prompt"]}], "chosen": [{"role": "assistant", "content": r["chosen"]}],
     "rejected": [{"role": "assistant", "content": r["rejected"]}]}
    for r in PLAIN
]
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    texts = [r["prompt"] + r["chosen"] + r["rejected"] for r in PLAIN] * 4
    tokenizer = train_tokenizer(texts, 300, tmp_path_factory.mktemp("tok"))
    # Like Llama's: a BOS in front of every encoding, so TRL's DPO (which lets the tokenizer add
    # special tokens) and ORPO/CPO (which add the BOS themselves) tokenize alike.
    tokenizer._tokenizer.post_processor = TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", tokenizer.bos_token_id)])
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def tiny_llama(tokenizer, seed: int, head: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id, num_labels=1,
    )
    model = (LlamaForSequenceClassification if head else LlamaForCausalLM)(config).float()
    with torch.no_grad():  # larger weights than the init: log-probs that differ visibly between answers
        for parameter in model.parameters():
            parameter.mul_(8 if parameter.dim() > 1 else 1)
    return model.train()


def ours(tokenizer, records, unpaired=False):
    units = [normalize_record(record) for record in records]
    if unpaired:  # TRL's unpair_preference_dataset order: every desirable example, then every undesirable one
        halves = [unpair(unit) for unit in units]
        units = [pair[0] for pair in halves] + [pair[1] for pair in halves]
    items = []
    for unit in units:
        done = tokenize_record(tokenizer, unit, max_seq_len=512)
        item = {"index": len(items), "prompt": done.prompt, "chosen": done.completions[0]}
        if unpaired:
            item["label"] = done.label
        else:
            item["rejected"] = done.completions[1]
        items.append(item)
    collate = collate_unpaired if unpaired else collate_pairs
    return collate(items, tokenizer.pad_token_id)


def logits(model, batch, prefix=""):
    return model(input_ids=batch[f"{prefix}input_ids"], attention_mask=batch[f"{prefix}attention_mask"]).logits


def assert_same(ours_loss, figures, trl_loss, trl_figures, names):
    assert float(ours_loss) == pytest.approx(float(trl_loss), abs=TOLERANCE)
    for mine, theirs in names.items():
        assert float(figures[mine]) == pytest.approx(trl_figures[theirs][-1] if isinstance(trl_figures[theirs], list) else trl_figures[theirs], abs=TOLERANCE), mine


DPO_NAMES = {"rewards_chosen": "rewards/chosen", "rewards_rejected": "rewards/rejected", "rewards_margin": "rewards/margins",
             "rewards_accuracy": "rewards/accuracies", "logps_chosen": "logps/chosen", "logps_rejected": "logps/rejected"}


def trl_args(cls, tmp_path, **kwargs):
    return cls(output_dir=str(tmp_path), per_device_train_batch_size=len(PLAIN), report_to=[], use_cpu=True, bf16=False, fp16=False, **kwargs)


@pytest.mark.parametrize(
    "records, loss_type, loss_weights",
    [(PLAIN, ["sigmoid"], None), (CONVERSATIONS, ["ipo", "sft"], [1.0, 0.5]), (PLAIN, ["robust"], None), (CONVERSATIONS, ["hinge"], None)],
    ids=["sigmoid-plain", "ipo+sft-chat", "robust-plain", "hinge-chat"],
)
def test_dpo_matches_trl(tokenizer, tmp_path, records, loss_type, loss_weights):
    from trl import DPOConfig, DPOTrainer

    policy, reference = tiny_llama(tokenizer, 0), tiny_llama(tokenizer, 1).eval()
    smoothing = 0.1 if loss_type == ["robust"] else 0.0
    extra = {"loss_weights": loss_weights} if loss_weights else {}
    trainer = DPOTrainer(
        model=copy.deepcopy(policy), ref_model=copy.deepcopy(reference), processing_class=tokenizer, train_dataset=Dataset.from_list(records),
        args=trl_args(DPOConfig, tmp_path, beta=0.2, loss_type=loss_type, label_smoothing=smoothing, max_length=None, **extra),
    )
    trl_batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(records))])
    trl_loss = trainer.compute_loss(trainer.model, trl_batch)

    batch = ours(tokenizer, records)
    assert torch.equal(batch["input_ids"], trl_batch["input_ids"]) and torch.equal(batch["completion_mask"], trl_batch["completion_mask"])
    settings = PreferenceSettings(method="dpo", loss_type=tuple(loss_type), loss_weights=tuple(loss_weights) if loss_weights else None, beta=0.2, label_smoothing=smoothing)
    with torch.no_grad():
        ref_chosen, ref_rejected = sequence_logps(logits(reference, batch), batch)[0].chunk(2)
    loss, figures = dpo_loss(settings, logits(policy, batch), batch, ref_chosen, ref_rejected)
    assert_same(loss, figures, trl_loss, trainer._metrics["train"], DPO_NAMES)
    assert 0 < float(figures["rewards_accuracy"]) < 1 or float(figures["rewards_margin"]) != 0  # a batch that tells losses apart


def test_orpo_matches_trl(tokenizer, tmp_path):
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    policy = tiny_llama(tokenizer, 0)
    trainer = ORPOTrainer(model=copy.deepcopy(policy), processing_class=tokenizer, train_dataset=Dataset.from_list(NEWLINE),
                          args=trl_args(ORPOConfig, tmp_path, beta=0.25, max_length=512))
    trl_batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(PLAIN))])
    trl_loss = trainer.compute_loss(trainer.model, trl_batch)
    batch = ours(tokenizer, NEWLINE)
    loss, figures = policy_loss(PreferenceSettings(method="orpo", beta=0.25), logits(policy, batch), batch, None)
    names = {**DPO_NAMES, "nll_loss": "nll_loss", "log_odds_ratio": "log_odds_ratio", "log_odds_chosen": "log_odds_chosen"}
    assert_same(loss, figures, trl_loss, trainer._stored_metrics["train"], names)


def test_simpo_matches_trl(tokenizer, tmp_path):
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    policy = tiny_llama(tokenizer, 0)
    trainer = CPOTrainer(model=copy.deepcopy(policy), processing_class=tokenizer, train_dataset=Dataset.from_list(NEWLINE),
                         args=trl_args(CPOConfig, tmp_path, loss_type="simpo", beta=2.0, simpo_gamma=0.7, cpo_alpha=0.3, max_length=512))
    trl_batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(PLAIN))])
    trl_loss = trainer.compute_loss(trainer.model, trl_batch)
    batch = ours(tokenizer, NEWLINE)
    settings = PreferenceSettings(method="simpo", beta=2.0, simpo_gamma=0.7, cpo_alpha=0.3)
    loss, figures = policy_loss(settings, logits(policy, batch), batch, None)
    assert_same(loss, figures, trl_loss, trainer._stored_metrics["train"], {**DPO_NAMES, "nll_loss": "nll_loss"})


def test_kto_with_kl_matches_trl(tokenizer, tmp_path):
    from trl import KTOConfig, KTOTrainer

    policy, reference = tiny_llama(tokenizer, 0), tiny_llama(tokenizer, 1).eval()
    rows = 2 * len(PLAIN)  # every pair unpaired into a desirable and an undesirable example
    trainer = KTOTrainer(
        model=copy.deepcopy(policy), ref_model=copy.deepcopy(reference), processing_class=tokenizer, train_dataset=Dataset.from_list(PLAIN),
        args=KTOConfig(output_dir=str(tmp_path), per_device_train_batch_size=rows, report_to=[], use_cpu=True, bf16=False, beta=0.3,
                       desirable_weight=1.5, undesirable_weight=0.8, max_length=None),
    )
    trl_batch = trainer.data_collator([trainer.train_dataset[i] for i in range(rows)])
    trl_loss = trainer.compute_loss(trainer.model, trl_batch)

    batch = ours(tokenizer, PLAIN, unpaired=True)
    assert torch.equal(batch["input_ids"], trl_batch["input_ids"]) and torch.equal(batch["KL_input_ids"], trl_batch["KL_input_ids"])
    settings = PreferenceSettings(method="kto", beta=0.3, desirable_weight=1.5, undesirable_weight=0.8)
    with torch.no_grad():
        ref_logps = sequence_logps(logits(reference, batch), batch)[0]
        ref_kl = sequence_logps(logits(reference, batch, "KL_"), batch, "KL_")[0]
        kl_logps = sequence_logps(logits(policy, batch, "KL_"), batch, "KL_")[0]
    loss, figures = kto_loss(settings, logits(policy, batch), batch, ref_logps, kl_logps, ref_kl)
    assert float(figures["kl"]) > 0  # the KL term is in play, not clamped away
    names = {k: v for k, v in DPO_NAMES.items() if k not in ("rewards_accuracy",)} | {"kl": "kl"}
    assert_same(loss, figures, trl_loss, trainer._metrics["train"], names)


def test_reward_model_matches_trl(tokenizer, tmp_path):
    from trl import RewardConfig, RewardTrainer

    model = tiny_llama(tokenizer, 0, head=True)
    trainer = RewardTrainer(model=copy.deepcopy(model), processing_class=tokenizer, train_dataset=Dataset.from_list(PLAIN),
                            args=trl_args(RewardConfig, tmp_path, max_length=None))
    trl_batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(PLAIN))])
    trl_loss = trainer.compute_loss(trainer.model, dict(trl_batch))
    batch = ours(tokenizer, PLAIN)
    scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss, figures = reward_loss(scores)
    names = {"rewards_accuracy": "accuracy", "rewards_margin": "margin", "min_reward": "min_reward", "mean_reward": "mean_reward", "max_reward": "max_reward"}
    assert_same(loss, figures, trl_loss, trainer._metrics["train"], names)
