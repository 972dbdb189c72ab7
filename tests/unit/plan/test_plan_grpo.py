"""The planner counts GRPO's generation round (the gathered weights, the KV cache) and its G sequences per prompt."""

from __future__ import annotations

from zeropipe.config.schema import GRPOSection, LoraSection, ModelSection, RunConfig
from zeropipe.families import model_spec as spec_from_config
from zeropipe.plan.hardware import Hardware
from zeropipe.plan.memory import GENERATION, Choice, peak_bytes
from zeropipe.plan.totals import per_gpu_terms

GIB = 1 << 30
LLAMA = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
         "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 4096}


def test_generation_round_and_reference_are_planned():
    lora = LoraSection(r=16, alpha=32)
    plain = spec_from_config(RunConfig(model=ModelSection(config=LLAMA, lora=lora)))
    grpo = spec_from_config(RunConfig(model=ModelSection(config=LLAMA, lora=lora), grpo=GRPOSection(num_generations=8, max_completion_length=512, beta=0.04)))
    assert grpo.sequences_per_example == 8 and grpo.reference_forward and plain.generation is None
    hardware = Hardware(gpus_per_node=2, gpu_memory_bytes=24 * GIB, nodes=1, host_ram_bytes=64 * GIB, gpu_name="NVIDIA GeForce RTX 4090", accelerator="cuda")
    choice = Choice(zero_stage=3, precision="bf16", micro_batch_size=2, seq_len=256, gradient_checkpointing=True)
    terms = {t.name: t for t in per_gpu_terms(grpo, hardware, choice)}
    gathered, kv = terms["weights gathered for generation"], terms["KV cache of the completions"]
    assert gathered.phase == kv.phase == GENERATION
    assert gathered.bytes == grpo.total_params * 2  # the whole model in bf16, once per round
    # 2 prompts x 8 completions, (256 + 512) positions, 22 layers, keys and values of 4 heads x 64, bf16
    assert kv.bytes == 2 * 22 * 256 * 16 * 768 * 2
    assert peak_bytes(list(terms.values())) > peak_bytes(per_gpu_terms(plain, hardware, choice))
    stage2 = {t.name for t in per_gpu_terms(grpo, hardware, Choice(zero_stage=2, precision="bf16", micro_batch_size=2, seq_len=256))}
    assert "weights gathered for generation" not in stage2 and "KV cache of the completions" in stage2  # stages 0-2 hold the weights already


def test_a_full_fine_tunes_reference_copy_is_planned_partitioned_under_zero3():
    full = spec_from_config(RunConfig(model=ModelSection(config=LLAMA), grpo=GRPOSection(num_generations=8, max_completion_length=512, beta=0.04)))
    lora = spec_from_config(RunConfig(model=ModelSection(config=LLAMA, lora=LoraSection(r=16, alpha=32)), grpo=GRPOSection(beta=0.04)))
    free = spec_from_config(RunConfig(model=ModelSection(config=LLAMA), grpo=GRPOSection(beta=0.0)))
    assert full.generation.reference_copy and not lora.generation.reference_copy and not free.generation.reference_copy
    hardware = Hardware(gpus_per_node=2, gpu_memory_bytes=24 * GIB, nodes=1, host_ram_bytes=64 * GIB, gpu_name="NVIDIA GeForce RTX 4090", accelerator="cuda")
    for stage, share in ((3, 2), (2, 1)):
        choice = Choice(zero_stage=stage, precision="bf16", micro_batch_size=2, seq_len=256, gradient_checkpointing=True)
        terms = {t.name: t for t in per_gpu_terms(full, hardware, choice)}
        reference = terms["KL reference (frozen copy)"]
        assert reference.bytes == full.total_params * 2 // share and reference.phase != GENERATION  # held all along, in bf16
        without = {t.name for t in per_gpu_terms(free, hardware, choice)}
        assert "KL reference (frozen copy)" not in without
