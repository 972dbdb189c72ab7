"""The streaming loader without DeepSpeed: index, matching, errors, and equality with from_pretrained."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from zeropipe.errors import CheckpointError
from zeropipe.models.checkpoint_index import CheckpointIndex, covering_rows, partition_range
from zeropipe.models.loading import load_pretrained

TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "vocab_size": 300,
}
IDS = torch.tensor([[1, 5, 9, 14, 20, 33, 250, 7]])


def save_tiny(directory, *, disk_dtype=torch.float32, tied=False, shard=None, safe=True):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY, tie_word_embeddings=tied)).to(disk_dtype)
    if not safe:
        # transformers 5 writes safetensors only; a .bin checkpoint is what older tools left.
        model.config.save_pretrained(directory)
        torch.save(model.state_dict(), directory / "pytorch_model.bin")
        return directory
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(directory, **kwargs)
    return directory


def reference(directory, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)


def assert_same_model(loaded, expected):
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, expected(IDS).logits)
    ours = dict(loaded.state_dict())
    theirs = dict(expected.state_dict())
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
    buffers = dict(loaded.named_buffers())
    for key, value in expected.named_buffers():
        assert torch.equal(buffers[key], value), key


@pytest.mark.parametrize(
    "disk_dtype, dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)],
    ids=["fp32-fp32", "bf16-fp32", "bf16-bf16"],
)
@pytest.mark.parametrize("layout", ["single", "sharded-tied", "bin"])
def test_loaded_model_equals_from_pretrained(tmp_path, disk_dtype, dtype, layout):
    from transformers import AutoModelForCausalLM

    directory = save_tiny(
        tmp_path / "m", disk_dtype=disk_dtype, tied=layout == "sharded-tied", shard="20KB" if layout == "sharded-tied" else None, safe=layout != "bin"
    )
    index = CheckpointIndex(directory)
    assert index.format == ("bin" if layout == "bin" else "safetensors")
    assert (len(index.files) > 1) == (layout == "sharded-tied")
    loaded = load_pretrained(AutoModelForCausalLM, directory, dtype=dtype, zero_stage=0, device="cpu")
    expected = reference(directory, dtype)
    assert not loaded.training  # eval mode, as from_pretrained returns it
    assert_same_model(loaded, expected)
    if layout == "sharded-tied":
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_training_never_writes_into_the_checkpoint(tmp_path):
    """On CPU same-dtype weights are copy-on-write views of the file: updates stay in the process."""
    from transformers import AutoModelForCausalLM

    directory = save_tiny(tmp_path / "m", disk_dtype=torch.bfloat16)
    before = load_file(directory / "model.safetensors")
    model = load_pretrained(AutoModelForCausalLM, directory, dtype=torch.bfloat16, zero_stage=0, device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    del model
    after = load_file(directory / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_index_reads_headers_of_every_shard(tmp_path):
    directory = save_tiny(tmp_path / "m", disk_dtype=torch.bfloat16, shard="20KB")
    index = CheckpointIndex(directory)
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(weight_map)
    for name, shard in weight_map.items():
        entry = index[name]
        assert entry.file.name == shard and entry.dtype == torch.bfloat16
    assert index["model.embed_tokens.weight"].shape == (300, 32)
    assert index.total_bytes == sum(t.numel() * t.element_size() for f in index.files for t in load_file(f).values())


def test_copy_elements_reads_any_range_in_small_chunks(tmp_path):
    tensors = {"matrix": torch.randn(37, 11, 3), "vector": torch.randn(101).to(torch.bfloat16), "scalar": torch.tensor(3.5)}
    save_file(tensors, tmp_path / "t.safetensors")
    index = CheckpointIndex(tmp_path / "t.safetensors")
    rng = random.Random(0)
    for name, tensor in tensors.items():
        flat = tensor.reshape(-1)
        for _ in range(100):
            start = rng.randrange(flat.numel())
            stop = rng.randrange(start, flat.numel()) + 1
            destination = torch.empty(stop - start, dtype=torch.float64)
            index.copy_elements(name, destination, start, chunk_bytes=rng.choice([1, 64, 500, 10**6]))
            assert torch.equal(destination, flat[start:stop].double()), (name, start, stop)


def test_partition_range_follows_deepspeed_padding():
    # 10 elements on 4 ranks: DeepSpeed pads to 12, partitions of 3; the last holds 1 real element.
    assert [partition_range(10, 3, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    # 5 elements on 4 ranks: partitions of 2; rank 3 holds only padding.
    assert [partition_range(5, 2, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (6, 6)]
    assert covering_rows(5, 14, 4) == (1, 4)
    assert covering_rows(8, 12, 4) == (2, 3)


# ------------------------------------------------------------------------- errors
def rewrite(directory, change):
    """Apply change(tensors) to model.safetensors and save it back (metadata kept)."""
    path = directory / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def load_error(directory) -> str:
    from transformers import AutoModelForCausalLM

    with pytest.raises(CheckpointError) as caught:
        load_pretrained(AutoModelForCausalLM, directory, dtype=torch.float32, zero_stage=0, device="cpu")
    return str(caught.value)


def test_missing_unexpected_and_wrong_shape_are_reported_together(tmp_path):
    directory = save_tiny(tmp_path / "m")

    def damage(tensors):
        del tensors["model.layers.1.mlp.up_proj.weight"]
        tensors["model.layers.0.extra.weight"] = torch.zeros(2)
        tensors["model.norm.weight"] = torch.ones(31)

    rewrite(directory, damage)
    message = load_error(directory)
    assert "3 problem(s)" in message
    assert "missing tensor model.layers.1.mlp.up_proj.weight: not in model.safetensors" in message
    assert "unexpected tensor model.layers.0.extra.weight in model.safetensors" in message
    assert "tensor model.norm.weight in model.safetensors has shape [31], LlamaForCausalLM expects [32]" in message


def test_truncated_file_names_file_and_tensors_past_its_end(tmp_path):
    directory = save_tiny(tmp_path / "m", shard="20KB")
    shard = sorted(directory.glob("model-*.safetensors"))[-1]
    last = max(CheckpointIndex(directory).entries.values(), key=lambda e: (e.file == shard, e.offset))
    shard.write_bytes(shard.read_bytes()[:-100])
    message = load_error(directory)
    assert f"{shard.name} is truncated" in message and last.name in message


def test_missing_shard_and_wrong_index_entry(tmp_path):
    directory = save_tiny(tmp_path / "m", shard="20KB")
    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    wrong = index["weight_map"]["model.layers.0.mlp.down_proj.weight"]
    index["weight_map"]["model.layers.0.mlp.down_proj.weight"] = "model-00001-of-00009.safetensors"
    index_file.write_text(json.dumps(index))
    message = load_error(directory)
    assert "shard model-00001-of-00009.safetensors is missing" in message and "model.layers.0.mlp.down_proj.weight" in message

    index["weight_map"]["model.layers.0.mlp.down_proj.weight"] = wrong
    index["weight_map"]["model.layers.0.mlp.phantom.weight"] = wrong
    index_file.write_text(json.dumps(index))
    message = load_error(directory)
    assert f"puts tensor model.layers.0.mlp.phantom.weight in {wrong}, but {wrong} does not contain it" in message


def test_no_weights_and_unreadable_header(tmp_path):
    (tmp_path / "empty").mkdir()
    assert "no weights in" in load_error_index(tmp_path / "empty")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((50).to_bytes(8, "little") + b"{not json" + b" " * 41)
    assert "unreadable safetensors header" in load_error_index(bad)


def load_error_index(path) -> str:
    with pytest.raises(CheckpointError) as caught:
        CheckpointIndex(path)
    return str(caught.value)


def test_old_rotary_buffers_in_checkpoint_are_ignored_like_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    directory = save_tiny(tmp_path / "m")
    rewrite(directory, lambda tensors: tensors.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}))
    loaded = load_pretrained(AutoModelForCausalLM, directory, dtype=torch.float32, zero_stage=0, device="cpu")
    assert_same_model(loaded, reference(directory, torch.float32))


def test_tied_weights_present_twice_are_tied_when_equal_and_refused_when_not(tmp_path):
    from transformers import AutoModelForCausalLM

    directory = save_tiny(tmp_path / "m", tied=True)
    rewrite(directory, lambda tensors: tensors.update({"lm_head.weight": tensors["model.embed_tokens.weight"].clone()}))
    loaded = load_pretrained(AutoModelForCausalLM, directory, dtype=torch.float32, zero_stage=0, device="cpu")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert_same_model(loaded, reference(directory, torch.float32))

    rewrite(directory, lambda tensors: tensors["lm_head.weight"].add_(1.0))
    message = load_error(directory)
    assert "ties lm_head.weight to model.embed_tokens.weight" in message and "tie_word_embeddings: false" in message


def test_checkpoint_with_only_the_tied_output_head_loads_into_the_input_embedding(tmp_path):
    from transformers import AutoModelForCausalLM

    directory = save_tiny(tmp_path / "m", tied=True)
    rewrite(directory, lambda tensors: tensors.update({"lm_head.weight": tensors.pop("model.embed_tokens.weight")}))
    loaded = load_pretrained(AutoModelForCausalLM, directory, dtype=torch.float32, zero_stage=0, device="cpu")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert_same_model(loaded, reference(directory, torch.float32))


def test_build_model_uses_the_loader_for_model_path(tmp_path):
    from zeropipe.config.schema import ModelSection
    from zeropipe.families.causal_lm.model import build_model
    from zeropipe.models.common import model_config

    directory = save_tiny(tmp_path / "m", disk_dtype=torch.bfloat16)
    section = ModelSection(path=str(directory))
    model = build_model(section, model_config(section), "fp32", zero_stage=0)
    assert not model.config.use_cache
    assert_same_model(model, reference(directory, torch.float32))
    rewrite(directory, lambda tensors: tensors.pop("model.norm.weight"))
    with pytest.raises(CheckpointError, match="missing tensor model.norm.weight"):
        build_model(section, model_config(section), "fp32", zero_stage=0)


def test_any_module_loads_through_a_factory(tmp_path):
    """What the diffusion family uses: a function building the model, weights under another stem."""

    def build():
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))

    torch.manual_seed(0)
    source = build().to(torch.bfloat16)
    save_file(source.state_dict(), tmp_path / "diffusion_pytorch_model.safetensors")
    loaded = load_pretrained(build, tmp_path, dtype=torch.float32, zero_stage=0, device="cpu", stem="diffusion_pytorch_model")
    for key, value in source.state_dict().items():
        assert loaded.state_dict()[key].dtype == torch.float32 and torch.equal(loaded.state_dict()[key], value.float())
    save_file({k: v for k, v in source.state_dict().items() if k != "1.bias"}, tmp_path / "diffusion_pytorch_model.safetensors")
    with pytest.raises(CheckpointError, match="missing tensor 1.bias: not in diffusion_pytorch_model.safetensors"):
        load_pretrained(build, tmp_path, dtype=torch.float32, zero_stage=0, device="cpu", stem="diffusion_pytorch_model")


def test_a_causal_lm_checkpoint_loads_as_a_reward_model_with_a_new_score_head(tmp_path):
    """new_head: the sequence classifier's score head is initialised, lm_head left unread, the base loaded as from_pretrained loads it."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    directory = save_tiny(tmp_path / "m")
    config = AutoConfig.from_pretrained(directory)
    config.num_labels, config.pad_token_id = 1, 0
    with pytest.raises(CheckpointError, match="missing tensor score.weight"):
        load_pretrained(AutoModelForSequenceClassification, directory, dtype=torch.float32, zero_stage=0, device="cpu", config=config)
    loaded = load_pretrained(AutoModelForSequenceClassification, directory, dtype=torch.float32, zero_stage=0, device="cpu", config=config, new_head=True)
    expected = AutoModelForSequenceClassification.from_pretrained(directory, config=config, dtype=torch.float32)
    ours, theirs = loaded.state_dict(), expected.state_dict()
    assert ours.keys() == theirs.keys() and "lm_head.weight" not in ours
    for key, value in theirs.items():
        if key != "score.weight":  # both initialised at random
            assert torch.equal(ours[key], value), key
    assert ours["score.weight"].shape == (1, TINY["hidden_size"]) and torch.isfinite(ours["score.weight"]).all() and ours["score.weight"].abs().sum() > 0
