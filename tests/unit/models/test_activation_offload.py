"""train.activation_offload (zeropipe.models.checkpointing): the same gradients, exactly the checkpointed inputs moved, and the planner's terms.

Each family's model is checkpointed through ``enable_checkpointing``; with offload, the hooks copy
every tensor a checkpointed block saves for its recomputation into fresh host memory and read it
back in backward. The tests compare with plain checkpointing (fp32: bit-identical gradients), count
the bytes moved against the planner's term, and measure the host RAM it holds.
"""

from __future__ import annotations

import copy
import gc

import psutil
import pytest
import torch

from zeropipe.config.schema import ModelSection, RunConfig
from zeropipe.families import model_spec as spec_from_config
from zeropipe.models.checkpointing import OffloadCounter, enable_checkpointing, offload_counter
from zeropipe.plan.hardware import Hardware
from zeropipe.plan.activations import activation_offload_traffic_bytes, offloaded_activation_bytes
from zeropipe.plan.memory import Choice, peak_bytes
from zeropipe.plan.totals import per_gpu_terms, per_node_terms

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2}


def _llama(fields=LLAMA, vocab=300):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{k: v for k, v in fields.items() if k != "model_type"}, vocab_size=vocab)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_a_causal_lm_trains_the_same_and_moves_what_the_planner_counts():
    torch.manual_seed(0)
    plain = _llama()
    offloaded = copy.deepcopy(plain)
    enable_checkpointing(plain)
    enable_checkpointing(offloaded, offload=True)
    counter = offload_counter(offloaded)
    assert counter is not None and offload_counter(plain) is None
    ids = torch.randint(0, 300, (2, 24))
    for model in (plain, offloaded):
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
    expected, got = _grads(plain), _grads(offloaded)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    # The planner: 3 layers x (2 x 24 tokens) x 64 hidden x 4 bytes (fp32), one copy per layer.
    spec = spec_from_config(RunConfig(model=ModelSection(config=LLAMA, tokenizer_vocab_size=300)))
    choice = Choice(precision="fp32", gradient_checkpointing=True, activation_offload=True, micro_batch_size=2, seq_len=24, gradient_accumulation_steps=3)
    assert counter.bytes == offloaded_activation_bytes(spec, choice) == 3 * 2 * 24 * 64 * 4
    assert counter.copies == 3
    # Out in forward and back in backward, for each of the 3 micro-batches of a step.
    assert activation_offload_traffic_bytes(spec, choice) == 2 * 3 * counter.bytes


def test_a_diffusion_transformer_trains_the_same_and_its_trace_counts_the_copies():
    """A tiny Flux transformer: both streams and the shared embeddings are handed to each block; the planner's meta-device trace counts each copy."""
    from diffusers import FluxTransformer2DModel

    from zeropipe.plan.trace import trace_diffusion

    fields = dict(patch_size=1, in_channels=8, num_layers=1, num_single_layers=2, attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=16, axes_dims_rope=[2, 2, 4])
    torch.manual_seed(0)
    plain = FluxTransformer2DModel(**fields)
    offloaded = copy.deepcopy(plain)

    def inputs():
        generator = torch.Generator().manual_seed(1)
        return {
            "hidden_states": torch.randn(2, 16, 8, generator=generator),
            "encoder_hidden_states": torch.randn(2, 6, 16, generator=generator),
            "pooled_projections": torch.randn(2, 16, generator=generator),
            "timestep": torch.tensor([0.5, 0.25]),
            "img_ids": torch.zeros(16, 3),
            "txt_ids": torch.zeros(6, 3),
        }

    enable_checkpointing(plain)
    enable_checkpointing(offloaded, offload=True)
    for model in (plain, offloaded):
        model.train()
        model(**inputs()).sample.square().mean().backward()
    expected, got = _grads(plain), _grads(offloaded)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    counter = offload_counter(offloaded)
    assert counter.blocks == 3 and counter.bytes > 0

    # The planner's trace runs the same function on the meta device (bf16): the same copies, at half the bytes.
    with torch.device("meta"):
        skeleton = FluxTransformer2DModel(**fields).to(torch.bfloat16)
    trace = trace_diffusion(skeleton, lambda: {k: v.to("meta", torch.bfloat16 if v.is_floating_point() else v.dtype) for k, v in inputs().items()}, resolution=4)
    assert trace.checkpointed_blocks == 3
    assert sum(trace.offloaded_sizes) * 2 == counter.bytes


def test_a_vision_language_model_offloads_through_the_same_door():
    from transformers import AutoModelForImageTextToText, LlavaConfig

    config = LlavaConfig(
        text_config={"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 120},
        vision_config={"model_type": "clip_vision_model", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 16, "patch_size": 8},
        image_token_id=110,
    )
    torch.manual_seed(0)
    plain = AutoModelForImageTextToText.from_config(config)
    offloaded = copy.deepcopy(plain)
    enable_checkpointing(plain)
    enable_checkpointing(offloaded, offload=True)
    ids = torch.randint(0, 100, (1, 12))
    ids[0, 1:5] = 110  # 4 image tokens: (16 / 8)^2 patches
    pixels = torch.randn(1, 3, 16, 16)
    for model in (plain, offloaded):
        model.train()
        model(input_ids=ids, pixel_values=pixels, labels=ids).loss.backward()
    expected, got = _grads(plain), _grads(offloaded)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    # Both towers' layers are checkpointed: 2 vision layers and 2 language layers.
    assert offload_counter(offloaded).blocks == 4


def test_offload_without_checkpointed_blocks_is_refused():
    class NoBlocks(torch.nn.Module):
        def enable_gradient_checkpointing(self, gradient_checkpointing_func=None):
            pass  # a model whose checkpointing reaches no block

    with pytest.raises(ValueError, match="activation_offload"):
        enable_checkpointing(NoBlocks(), offload=True)


def test_planner_moves_the_inputs_from_the_gpu_to_host_ram():
    spec = spec_from_config(RunConfig(model=ModelSection(config={**LLAMA, "num_hidden_layers": 32, "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8}, tokenizer_vocab_size=300)))
    hardware = Hardware(gpus_per_node=4, gpu_memory_bytes=24 * 2**30, nodes=1, host_ram_bytes=64 * 2**30, accelerator="cuda")
    base = Choice(gradient_checkpointing=True, micro_batch_size=2, seq_len=8192)
    on = Choice(gradient_checkpointing=True, activation_offload=True, micro_batch_size=2, seq_len=8192)
    inputs = 32 * 2 * 8192 * 512 * 2  # layers x tokens x hidden x bf16
    assert offloaded_activation_bytes(spec, on) == inputs
    gpu_saved = peak_bytes(per_gpu_terms(spec, hardware, base)) - peak_bytes(per_gpu_terms(spec, hardware, on))
    # 31 of the 32 inputs leave the GPU (the one being recomputed comes back), and the fragmentation allowance on them.
    assert gpu_saved == pytest.approx(31 / 32 * inputs * 1.1, rel=0.01)
    host = {t.name: t.bytes for t in per_node_terms(spec, hardware, on)}
    assert host["offloaded activations"] == 4 * inputs  # 4 ranks; 16 MiB copies are powers of two already: no pinned rounding
    assert "offloaded activations" not in {t.name for t in per_node_terms(spec, hardware, base)}
    assert activation_offload_traffic_bytes(spec, base) == 0


def _release_freed_memory() -> None:
    """Collect, then hand glibc's freed pages back to the system, so RSS shows what live tensors hold."""
    import ctypes

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def test_host_ram_held_is_the_planners_term():
    """RSS held by a forward pass whose checkpointed inputs dominate: the planner's host term, within 5%.

    Measured as the RSS the graph frees when it is dropped (freed pages trimmed back to the system
    before each reading), less the decoder's output and the final norm's saved input, which lie
    outside the checkpointed layers. On a CPU rank the offloaded copies replace the tensors they
    copy (the originals are freed), so the RSS with offload equals the RSS without, as the planner's
    node total says (its per-GPU term, host RAM too on CPU ranks, drops what its host term gains).
    Measured under load on 2 cores: 50.9 MB held with offload (50.8 MB without) against 50.3 MB
    planned (+1.2%); at 24 layers and 32768 tokens, before the rotary tables were set apart, 210.9 MB
    against 201.3 MB (+4.7%, those tables).
    """
    fields = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 12, "num_attention_heads": 2, "num_key_value_heads": 1}
    batch, seq = 64, 256  # 16384 tokens x 64 x 4 bytes = 4 MiB per layer input, 48 MiB in all
    spec = spec_from_config(RunConfig(model=ModelSection(config=fields, tokenizer_vocab_size=300)))
    choice = Choice(precision="fp32", gradient_checkpointing=True, activation_offload=True, micro_batch_size=batch, seq_len=seq)
    hardware = Hardware(gpus_per_node=1, gpu_memory_bytes=8 * 2**30, nodes=1, host_ram_bytes=8 * 2**30, accelerator="cpu")
    planned = {t.name: t.bytes for t in per_node_terms(spec, hardware, choice)}["offloaded activations"]
    assert planned == 12 * batch * seq * 64 * 4
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (batch, seq))
    process = psutil.Process()
    held = {}
    for offload in (False, True):
        model = _llama(fields)
        model.train()
        enable_checkpointing(model, offload=offload)
        out = model.model(input_ids=ids).last_hidden_state  # the decoder alone: the logits would be a term of their own
        # Outside the checkpointed layers: the output, the final norm's saved fp32 input, and the rotary tables (cos and
        # sin, batch x seq x head dim, fp32) handed to every layer as keywords and kept once.
        outside = 2 * out.numel() * out.element_size() + 2 * batch * seq * 32 * 4
        _release_freed_memory()
        with_graph = process.memory_info().rss
        del out
        _release_freed_memory()
        held[offload] = with_graph - process.memory_info().rss - outside
        del model
    assert held[True] == pytest.approx(planned, rel=0.05), (held, planned)
    assert held[True] == pytest.approx(held[False], rel=0.05)


def test_check_refuses_offload_without_checkpointing(tmp_path):
    from zeropipe.check.run import check_config
    from zeropipe.config.load import validate_config

    data = tmp_path / "train.jsonl"
    data.write_text('{"instruction": "hi", "output": "yo"}\n')

    def findings(**model):
        raw = {"model": {"config": {"model_type": "llama", "hidden_size": 32}, **model}, "data": {"path": str(data)}, "train": {"activation_offload": True}}
        return [f for f in check_config(validate_config(raw)) if f.rule == "ZP047"]

    refused = findings()
    assert len(refused) == 1 and refused[0].severity == "error" and refused[0].key == "train.activation_offload"
    assert "model.gradient_checkpointing: true" in refused[0].fix
    assert findings(gradient_checkpointing=True) == []


def test_zero3_on_one_rank_plans_no_gathered_copy():
    """DeepSpeed gathers nothing when a parameter's partition group is one rank (NoGatherHandle: a view of the
    rank's own partition), so the plan counts no gathered or kept-gathered weights there, unless they are offloaded."""
    from zeropipe.config.schema import LoraSection

    spec = spec_from_config(RunConfig(model=ModelSection(config={**LLAMA, "hidden_size": 256, "intermediate_size": 512}, tokenizer_vocab_size=300, lora=LoraSection(r=8))))

    def gathered(gpus: int, offload_param: bool = False) -> int:
        hardware = Hardware(gpus_per_node=gpus, gpu_memory_bytes=24 * 2**30, nodes=1, host_ram_bytes=64 * 2**30)
        choice = Choice(zero_stage=3, offload_param=offload_param, micro_batch_size=1, seq_len=128)
        return sum(t.bytes for t in per_gpu_terms(spec, hardware, choice) if "(ZeRO-3)" in t.name)

    assert gathered(1) == 0
    assert gathered(2) > 0 and gathered(1, offload_param=True) > 0


def test_a_configs_plan_follows_its_activation_offload(tmp_path, capsys):
    import json

    from zeropipe.cli.main import main

    config = tmp_path / "run.yaml"
    config.write_text(
        "model: {config: {model_type: llama, hidden_size: 512, intermediate_size: 1024, num_hidden_layers: 16, num_attention_heads: 8}, gradient_checkpointing: true}\n"
        "data: {synthetic: {task: mixed}, max_seq_len: 4096}\ntrain: {activation_offload: true, micro_batch_size: 2}\ndeepspeed: {zero_stage: 2}\n"
    )
    main(["plan", str(config), "--gpus", "2x24GB", "--ram", "64GB", "--json"])
    configured = json.loads(capsys.readouterr().out)["configured"]
    assert configured["choice"]["activation_offload"] is True
    host = {t["name"]: t["bytes"] for t in configured["per_node_terms"]}
    assert host["offloaded activations"] == 2 * 16 * 2 * 4096 * 512 * 2  # 2 ranks x 16 layers x tokens x hidden x bf16
