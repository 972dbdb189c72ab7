"""The planner's activation terms under sequence parallelism: each rank holds 1/N of a sample's tokens (issue 40)."""

from dataclasses import replace

from zeropipe.plan.activations import activation_terms, saved_activation_bytes
from zeropipe.plan.memory import Choice


def test_activation_terms_fall_to_one_over_n(spec_of):
    spec = spec_of("llama-3.2-1b")
    for checkpointing in (False, True):
        # The untiled loss: auto would tile 4096 x 128k logits (2 GiB) but not 2048 x 128k, and the terms would not halve.
        one = Choice(precision="fp32", seq_len=4096, micro_batch_size=1, gradient_checkpointing=checkpointing, tiled_loss=False)
        two = replace(one, sequence_parallel=2)
        assert [t.bytes for t in activation_terms(spec, two)] == [t.bytes // 2 for t in activation_terms(spec, one)]
        assert saved_activation_bytes(spec, two) == saved_activation_bytes(spec, one) // 2
        assert "s=4096/2 (sequence parallel)" in activation_terms(spec, two)[0].explanation
    assert "sequence parallel 2" in two.describe()


GIB = 1024**3


def box(gpus: int, ram_gib: int = 64):
    from zeropipe.plan.hardware import Hardware

    return Hardware(gpus_per_node=gpus, gpu_memory_bytes=24 * GIB, nodes=1, host_ram_bytes=ram_gib * GIB, gpu_name="NVIDIA GeForce RTX 4090", accelerator="cuda")


def test_a_dits_traced_activations_fall_to_one_over_n_and_the_all_to_all_is_priced(spec_of):
    from zeropipe.plan.cost import sequence_parallel_bytes, step_seconds
    from zeropipe.plan.variants import with_caches

    spec = with_caches(spec_of("wan2.1-t2v-14b", 16))
    one = Choice(precision="bf16", micro_batch_size=1, gradient_checkpointing=True, zero_stage=3)
    five = replace(one, sequence_parallel=5)
    assert saved_activation_bytes(spec, five) == saved_activation_bytes(spec, one) // 5
    named = {t.name: t.bytes for t in activation_terms(spec, one)}
    split = {t.name: t.bytes for t in activation_terms(spec, five)}
    assert split["activations (checkpointed block inputs)"] == named["activations (checkpointed block inputs)"] // 5
    # q, k, v and the output of each of the 40 layers, forward, backward and recomputed: 12 x the block inputs x 1/5 x 4/5 sent
    trace = spec.activation_trace
    assert sequence_parallel_bytes(spec, five) == 12 * trace.checkpointed_bytes / 5 * 4 / 5
    seconds, split_seconds = step_seconds(spec, box(5), one), step_seconds(spec, box(5), five)
    assert split_seconds["sequence_parallel"] > 0 == seconds["sequence_parallel"]
    # each rank computes 1/5 of each sample (the fixed per-micro-step overhead is not split)
    assert abs(split_seconds["compute"] * 5 - seconds["compute"]) < 1e-3 * seconds["compute"]


def test_the_degrees_offered_split_the_heads_and_the_ranks(spec_of):
    from zeropipe.plan.variants import sequence_parallel_degrees

    assert sequence_parallel_degrees(spec_of("wan2.1-t2v-14b"), 5) == [5]  # 40 heads
    assert sequence_parallel_degrees(spec_of("wan2.1-t2v-14b"), 8) == [2, 4, 8]
    assert sequence_parallel_degrees(spec_of("llama-3.2-1b"), 4) == [2, 4]  # 32 heads, 8 key/value heads
    assert sequence_parallel_degrees(spec_of("sdxl"), 4) == []  # a UNet: no context-parallel plan


def test_the_search_picks_the_degree_when_nothing_fits_without_it(spec_of):
    from zeropipe.plan.search import search
    from zeropipe.plan.variants import with_caches

    spec = with_caches(spec_of("wan2.1-t2v-14b", 16))
    result = search(spec, box(5), global_batch=5)
    assert result.best is not None and result.best.choice.sequence_parallel == 5
    assert [s.key for s in result.settings] == ["parallel.sequence_parallel_size: 5"]
    assert result.fragment()["parallel"] == {"sequence_parallel_size": 5}
    assert any(n.startswith("picked parallel.sequence_parallel_size: 5 (changes no result") for n in result.notes)
    # The largest clip each degree allows: more with the split.
    by_degree = result.largest_shape_by_degree
    assert set(by_degree) == {1, 5}
    frames = {d: max(s.frames for s in shapes) for d, shapes in by_degree.items()}
    assert frames[5] > frames[1]


def test_an_exact_degree_is_recommended_before_a_quality_change(capsys):
    """Wan 2.2 A14B LoRA on 5 x 24 GB, 64 GB: without a split only an fp8 base fits; 5 ranks split its 40 heads, which changes no result."""
    from zeropipe.cli.main import main

    assert main(["plan", "--model", "wan2.2-t2v-a14b", "--gpus", "5x24GB", "--ram", "64GB", "--lora-r", "32"]) == 0
    out = capsys.readouterr().out
    verdict = next(line for line in out.splitlines() if line.startswith(("Recommended", "Fits if you set")))
    assert verdict.startswith("Recommended: ZeRO-3") and verdict.split(" (relative")[0].endswith("sequence parallel 5"), verdict
    assert "  parallel:\n    sequence_parallel_size: 5" in out
