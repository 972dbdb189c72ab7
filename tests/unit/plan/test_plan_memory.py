"""The memory terms, one formula at a time, starting with the ZeRO paper's worked example."""

from __future__ import annotations

import pytest

from zeropipe.plan.hardware import GIB, parse_hardware
from zeropipe.plan.activations import checkpointed_layer_bytes, layer_activation_bytes, pinned_rounding_bytes
from zeropipe.plan.memory import FORWARD_BACKWARD, OPTIMIZER_STEP, Choice, Term, gradient_partition_elements, model_state_terms, peak_bytes
from zeropipe.plan.totals import per_gpu_terms, per_node_terms
from zeropipe.plan.model_spec import BlockShape, spec_from_params

PSI = 7_500_000_000  # the paper's 7.5B-parameter model on 64 GPUs (section 5.1, figure 1)


def model_states(stage: int, world: int = 64, params: int = PSI, **choice) -> int:
    return sum(t.bytes for t in model_state_terms(spec_from_params(params), world, Choice(zero_stage=stage, **choice)))


@pytest.mark.parametrize("stage,paper_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_worked_example(stage, paper_gb):
    # The paper's GB is 10^9 bytes and K = 12 (mixed-precision Adam). Its P_os (ZeRO-1) keeps
    # full gradients, which DeepSpeed does while it accumulates micro-batches, so the example
    # is computed for an accumulating run.
    assert round(model_states(stage, gradient_accumulation_steps=4) / 1e9, 1) == paper_gb


def test_paper_formulas_exactly():
    n = 64
    assert model_states(0, gradient_accumulation_steps=2) == 16 * PSI
    assert model_states(1, gradient_accumulation_steps=2) == 4 * PSI + 12 * PSI // n
    assert model_states(2) == 2 * PSI + 14 * PSI // n
    assert model_states(3) == 16 * PSI // n


def test_zero1_without_accumulation_holds_a_gradient_partition_like_zero2():
    # overlap_comm reduces the single micro-batch's gradients bucket by bucket during backward.
    assert model_states(1, gradient_accumulation_steps=1) == model_states(2)


def test_each_model_state_term_is_named_and_explained():
    terms = model_state_terms(spec_from_params(PSI), 64, Choice(zero_stage=0))
    assert [t.name for t in terms] == ["parameters (16-bit)", "gradients (16-bit)", "optimizer states"]
    assert [t.bytes for t in terms] == [2 * PSI, 2 * PSI, 12 * PSI]
    assert all(t.explanation for t in terms)
    assert "K=12" in terms[2].explanation


def test_fp32_without_zero_needs_no_master_copy():
    terms = {t.name: t.bytes for t in model_state_terms(spec_from_params(1000), 4, Choice(zero_stage=0, precision="fp32"))}
    assert terms == {"parameters (fp32)": 4000, "gradients (fp32)": 4000, "optimizer states": 8000}


def test_gradient_partition_keeps_straddling_parameters_whole():
    # 20 elements over 2 ranks: partitions [0, 10) and [10, 20); the middle parameter [5, 15) is held by both.
    assert gradient_partition_elements((5, 10, 5), 2) == 15
    assert gradient_partition_elements((10, 10), 2) == 10
    assert gradient_partition_elements((7,), 1) == 7


def test_offloading_moves_optimizer_states_and_parameters_to_host_ram():
    spec = spec_from_params(1_000_000_000)
    hardware = parse_hardware("4x24GB", "256GB")
    choice = Choice(zero_stage=3, offload_optimizer=True, offload_param=True)
    gpu = {t.name: t.bytes for t in per_gpu_terms(spec, hardware, choice)}
    host = {t.name: t.bytes for t in per_node_terms(spec, hardware, choice)}
    assert gpu["optimizer states"] == 0 and gpu["parameters (16-bit)"] == 0
    share = 1_000_000_000 // 4
    assert host["offloaded optimizer states"] == 4 * share * 12
    assert host["offloaded fp32 gradients"] == 4 * share * 4
    assert host["offloaded parameters"] == 4 * share * 2
    assert host["pinned-memory rounding (parameters)"] >= 0


def test_loading_peak_is_every_local_rank_at_once_below_zero3():
    spec = spec_from_params(3_000_000_000)
    hardware = parse_hardware("5x24GB", "64GB")
    every_rank = {t.name: t for t in per_node_terms(spec, hardware, Choice(zero_stage=2))}["model loading peak"]
    partitioned = {t.name: t for t in per_node_terms(spec, hardware, Choice(zero_stage=3))}["model loading peak"]
    staggered = {t.name: t for t in per_node_terms(spec, hardware, Choice(zero_stage=2, model_loading="staggered"))}["model loading peak"]
    assert every_rank.bytes == 5 * 3_000_000_000 * 2
    assert "SIGKILL" in every_rank.explanation
    assert staggered.bytes == 3_000_000_000 * 2
    assert partitioned.bytes == 5 * (3_000_000_000 // 5) * 2


def test_five_ranks_loading_sdxl_in_fp32_exceed_64_gb(spec_of):
    # The report this planner exists for: rank 0 SIGKILLed while 5 ranks load SDXL into 64 GB.
    sdxl = spec_of("sdxl")
    hardware = parse_hardware("5x24GB", "64GB")
    loading = {t.name: t.bytes for t in per_node_terms(sdxl, hardware, Choice(zero_stage=2, precision="fp32"))}["model loading peak"]
    assert loading > 64 * GIB
    zero3 = {t.name: t.bytes for t in per_node_terms(sdxl, hardware, Choice(zero_stage=3, precision="fp32"))}["model loading peak"]
    assert zero3 < 64 * GIB / 2  # zero.Init: each rank builds its share (the frozen encoders stay whole)


def test_zero3_gathers_the_largest_layer_and_prefetches(spec_of):
    llama = spec_of("llama-3.1-8b")
    terms = {t.name: t for t in per_gpu_terms(llama, parse_hardware("4x48GB", "256GB"), Choice(zero_stage=3))}
    gathered = terms["gathered layer + prefetch (ZeRO-3)"]
    assert llama.largest_layer_params == 128256 * 4096  # the embedding
    assert gathered.bytes == (2 * 128256 * 4096 + int(0.9 * 4096 * 4096)) * 2
    assert gathered.phase == FORWARD_BACKWARD
    assert "embed_tokens" in gathered.explanation


def test_peak_is_always_plus_the_larger_phase():
    terms = [Term("a", 10, "x"), Term("b", 5, "x", FORWARD_BACKWARD), Term("c", 3, "x", FORWARD_BACKWARD), Term("d", 7, "x", OPTIMIZER_STEP)]
    assert peak_bytes(terms) == 10 + 8


def test_pinned_memory_rounds_up_to_powers_of_two():
    assert pinned_rounding_bytes([3 * GIB]) == GIB
    assert pinned_rounding_bytes([4 * GIB, 0]) == 0


GPT_BLOCK = BlockShape(
    hidden=1024,
    q_dim=1024,
    kv_dim=1024,
    intermediate=4096,
    heads=16,
    gated_mlp=False,
    norm_elements=2048,
    layernorm=True,
    dropout=0.1,
    softmax_fp32=False,
)


def test_gpt_block_reduces_to_korthikanti_formula():
    # s·b·h·(34 + 5·a·s/h) bytes per layer for 16-bit activations (Korthikanti et al. 2022, eq. 1).
    s, b, h, a = 512, 4, 1024, 16
    expected = s * b * h * 34 + 5 * a * s * s * b
    assert layer_activation_bytes(GPT_BLOCK, s * b, s, "bf16", attention="eager") == expected


def test_fused_attention_drops_the_s_squared_term():
    short = layer_activation_bytes(GPT_BLOCK, 1024, 1024, "bf16", attention="sdpa")
    long = layer_activation_bytes(GPT_BLOCK, 1024, 8192, "bf16", attention="sdpa")
    assert short == long  # same tokens, no dependence on sequence length left


def test_llama_block_per_token():
    block = BlockShape(hidden=4096, q_dim=4096, kv_dim=1024, intermediate=14336, heads=32, norm_elements=8192)
    per_token = layer_activation_bytes(block, 1, 2048, "bf16")
    assert per_token == 20 * 4096 + 4 * 1024 + 8 * 14336 + 4 * 32  # + fp32 log-sum-exp per head


def test_checkpointing_keeps_two_bytes_per_hidden_value():
    assert checkpointed_layer_bytes(GPT_BLOCK, 1000, "bf16") == 2 * 1000 * 1024


def test_every_per_gpu_and_per_node_term_explains_itself(spec_of):
    spec = spec_of("qwen2.5-7b")
    hardware = parse_hardware("4x24GB", "128GB")
    for stage in range(4):
        choice = Choice(zero_stage=stage, offload_optimizer=stage > 0, gradient_checkpointing=True)
        terms = per_gpu_terms(spec, hardware, choice) + per_node_terms(spec, hardware, choice)
        assert all(t.name and t.explanation and t.bytes >= 0 for t in terms)
        names = [t.name for t in per_gpu_terms(spec, hardware, choice)]
        assert len(names) == len(set(names))


def kept_gathered(spec, choice: Choice, hardware) -> int:
    [term] = [t for t in per_gpu_terms(spec, hardware, choice) if t.name == "parameters kept gathered (ZeRO-3)"]
    return term.bytes


def test_zero3_keeps_up_to_max_live_parameters_gathered_on_every_rank():
    # DeepSpeed's defaults (1e9) keep a 0.4B model whole on each rank by the end of the forward
    # pass from the second step on (measured in benchmarks/real_scale.py): the per-rank figure
    # holds the full model, not just a 1/N share plus one layer.
    hardware = parse_hardware("4x24GB", "64GB")
    small, big = spec_from_params(400e6), spec_from_params(7e9)
    assert kept_gathered(small, Choice(zero_stage=3), hardware) == 400_000_000 * 2
    assert kept_gathered(big, Choice(zero_stage=3), hardware) == 1_000_000_000 * 2
    # Both limits at 0 release every layer after use; the reuse distance alone keeps half of it.
    released = Choice(zero_stage=3, zero3_max_live_parameters=0, zero3_reuse_distance=0)
    assert kept_gathered(big, released, hardware) == 0
    assert kept_gathered(big, Choice(zero_stage=3, zero3_max_live_parameters=0), hardware) == 500_000_000 * 2
    # Below ZeRO-3 nothing is gathered.
    assert not [t for t in per_gpu_terms(big, hardware, Choice(zero_stage=2)) if t.name == "parameters kept gathered (ZeRO-3)"]


def test_plan_run_reads_the_limits_from_deepspeed_overrides(tmp_path):
    from zeropipe.config.load import validate_config
    from zeropipe.families import model_spec
    from zeropipe.plan import plan_run

    data = tmp_path / "train.jsonl"
    data.write_text('{"instruction": "hi", "output": "yo"}\n')
    model = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 1000}

    def configured_kept(overrides: dict) -> int:
        config = validate_config(
            {
                "model": {"config": model},
                "data": {"path": str(data)},
                "deepspeed": {"zero_stage": 3, "precision": "bf16", "overrides": overrides},
                "hardware": {"gpus": 2},
            }
        )
        result = plan_run(config, parse_hardware("2x24GB", "64GB"), model_spec(config))
        return sum(t.bytes for t in result.configured.per_gpu_terms if t.name == "parameters kept gathered (ZeRO-3)")

    spec_params = 4 * (4 * 256 * 256 + 3 * 256 * 512 + 2 * 256) + 2 * 1000 * 256 + 256
    assert configured_kept({}) == pytest.approx(spec_params * 2, rel=0.01)
    assert configured_kept({"zero_optimization": {"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0}}) == 0


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ema_adds_four_bytes_per_trainable_weight_of_the_partition(stage):
    from dataclasses import replace

    spec, n = spec_from_params(PSI), 64
    plain = model_state_terms(spec, n, Choice(zero_stage=stage))
    with_ema = model_state_terms(replace(spec, ema=True), n, Choice(zero_stage=stage))
    added = [t for t in with_ema if t not in plain]
    assert [t.name for t in added] == ["EMA weights (fp32)"]
    assert added[0].bytes == 4 * (PSI if stage == 0 else -(-PSI // n))
    offloaded = model_state_terms(replace(spec, ema=True), n, Choice(zero_stage=stage, offload_optimizer=True)) if stage else []
    assert all(t.bytes == 0 for t in offloaded if t.name.startswith("EMA")), "an offloaded optimizer keeps the EMA in host RAM"


def test_a_run_config_with_train_ema_is_planned_with_its_term():
    from zeropipe.config.schema import RunConfig
    from zeropipe.families import model_spec

    tiny = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = {"model": {"config": tiny, "tokenizer_vocab_size": 300}, "data": {"synthetic": {"task": "arithmetic"}}}
    plain = model_spec(RunConfig.model_validate(config))
    with_ema = model_spec(RunConfig.model_validate({**config, "train": {"ema": {"decay": 0.99}}}))
    assert (plain.ema, with_ema.ema) == (False, True)
    terms = model_state_terms(with_ema, 2, Choice(zero_stage=3))
    assert [t.bytes for t in terms if t.name == "EMA weights (fp32)"] == [4 * -(-with_ema.trainable_params // 2)]
