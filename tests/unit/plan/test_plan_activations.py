"""The activation formula against the bytes autograd really saves for backward.

What the formula counts (memory.layer_activation_bytes): per decoder layer, every tensor a
Llama block saves for its backward pass in bf16 with fused attention (SDPA) -- the fp32
input and normalized value of each RMSNorm, the inputs of the linear layers, q/k/v and the
attention output, the log-sum-exp, the gated MLP's three intermediates -- which is
s·b·(20h + 4h_kv + 8i); with full activation checkpointing only each layer's input,
2·s·b·h; plus the final norm, the LM head's input and the fp32 log-softmax of the loss
(4·s·b·V). Weights are not activations and are left out.

The measurement runs a tiny transformers Llama on the CPU inside
``torch.autograd.graph.saved_tensors_hooks`` and adds up every tensor packed for backward,
once per storage (views share one), leaving out the model's parameters.
"""

from __future__ import annotations

import pytest
import torch

from zeropipe.config.schema import LoraSection, ModelSection, RunConfig
from zeropipe.families import model_spec as spec_from_config
from zeropipe.plan.activations import saved_activation_bytes
from zeropipe.plan.memory import Choice

TOLERANCE = 0.15
SEQ_LEN, BATCH = 256, 2

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "max_position_embeddings": SEQ_LEN,
    "tie_word_embeddings": False,
}


def measured_saved_bytes(section: ModelSection) -> int:
    from zeropipe.families.causal_lm.model import build_model
    from zeropipe.models.common import model_config

    torch.manual_seed(0)
    model = build_model(section, model_config(section), "bf16")
    # peft keeps adapters in fp32; DeepSpeed's bf16 engine casts every parameter to bf16 (buffers stay).
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    model.train()
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (BATCH, SEQ_LEN))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    assert loss.requires_grad
    return sum(saved.values())


@pytest.mark.parametrize(
    "checkpointing,attention,lora",
    [
        (False, "sdpa", None),
        (True, "sdpa", None),
        (False, "eager", None),
        (False, "sdpa", LoraSection(r=8, dropout=0.05)),
        (False, "sdpa", LoraSection(r=8, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])),
    ],
    ids=["sdpa", "sdpa-checkpointing", "eager", "lora-dropout", "lora-no-dropout"],
)
def test_activation_formula_matches_saved_tensors(checkpointing, attention, lora):
    section = ModelSection(config=dict(TINY_LLAMA), gradient_checkpointing=checkpointing, attn_implementation=attention, lora=lora)
    spec = spec_from_config(RunConfig(model=section))
    choice = Choice(precision="bf16", gradient_checkpointing=checkpointing, micro_batch_size=BATCH, seq_len=SEQ_LEN, attention=attention)
    planned = saved_activation_bytes(spec, choice)
    real = measured_saved_bytes(section)
    assert abs(planned - real) <= TOLERANCE * real, f"formula {planned:,} bytes, autograd saved {real:,} ({planned / real - 1:+.1%})"


def test_checkpointing_keeps_far_less():
    plain = spec_from_config(RunConfig(model=ModelSection(config=dict(TINY_LLAMA))))
    full = saved_activation_bytes(plain, Choice(micro_batch_size=BATCH, seq_len=SEQ_LEN))
    kept = saved_activation_bytes(plain, Choice(micro_batch_size=BATCH, seq_len=SEQ_LEN, gradient_checkpointing=True))
    assert kept < full / 2
