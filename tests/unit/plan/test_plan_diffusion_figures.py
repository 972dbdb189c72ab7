"""The planner's figures for a UNet, Flux's transformer and Wan's, pinned to the byte.

These are the figures the planner gave when it still traced the UNet, Flux and Wan by their
class names (main at 7151cc9); their input builders now live in the sdxl/sd15, flux and wan
entries (``Architecture.trace_inputs``). A change here changes every plan of those models:
it must be deliberate, and said in the commit.
"""

from __future__ import annotations

import pytest

from zeropipe.config.schema import RunConfig
from zeropipe.families.diffusion.spec import diffusion_config_spec
from zeropipe.plan import parse_hardware, recommend

TRACE_FIELDS = ("resolution", "frames", "saved_bytes", "checkpointed_bytes", "largest_block_bytes", "forward_flops")

CATALOG = {
    # name: (total parameters, (resolution, frames, saved, checkpointed, largest block, forward FLOPs)), bf16, one example
    "sdxl": (2_567_463_684, (1024, 1, 7_308_337_024, 587_672_448, 125_831_936, 6_761_236_398_080)),
    "flux.1-dev": (11_901_408_320, (1024, 1, 42_665_525_760, 1_697_210_880, 709_183_488, 74_384_653_418_496)),
    "wan2.1-t2v-1.3b": (1_418_996_800, (640, 81, 148_568_329_728, 3_626_188_800, 705_331_200, 295_456_546_750_464)),
}

# The plan on 8x80GB with 512GB of host RAM at the search's own global batch (128), as `zeropipe plan --model NAME --gpus 8x80GB --ram 512GB` gives it: the fastest choice that fits, and its bytes.
# Changed deliberately (issue 31, defect 6): the VAE the ranks encode with (catalog plans count no caches) is
# counted in fp32, as it is loaded, instead of 2 bytes per weight (+2 bytes x its weights per GPU and per rank in host RAM).
PLANS = {
    "sdxl": ((1, False, 4), 51_321_531_089, 74_019_736_864),
    "flux.1-dev": ((2, True, 8), 77_182_659_026, 288_450_570_336),
    "wan2.1-t2v-1.3b": ((1, True, 8), 58_874_428_204, 134_838_944_352),
}

TINY = {
    # (preset, LoRA rank): (total, trainable, (resolution, frames, saved, checkpointed, largest block, forward FLOPs)) at 64 px, clips of 9 frames
    ("tiny-sdxl", None): (1_028_708, 1_028_708, (64, 1, 7_727_872, 1_691_200, 786_752, 741_609_472)),
    ("tiny-sdxl", 8): (1_061_476, 32_768, (64, 1, 8_913_664, 1_321_024, 786_496, 755_453_952)),
    ("tiny-sd15", None): (985_444, 985_444, (64, 1, 7_722_272, 1_685_600, 786_752, 739_033_088)),
    ("tiny-flux", None): (70_288, 70_288, (64, 1, 2_968_000, 257_024, 1_253_696, 191_422_464)),
    ("tiny-flux", 8): (73_872, 3_584, (64, 1, 2_198_720, 149_632, 1_327_360, 194_830_336)),
    ("tiny-flux-kontext", None): (70_288, 70_288, (64, 1, 2_968_000, 257_024, 1_253_696, 191_422_464)),
    ("tiny-wan", None): (40_864, 40_864, (64, 9, 344_704, 45_184, 9_216, 4_538_368)),
    # Changed deliberately (issue 33): LoRA's "auto" targets are the entry's own, as training adapts them (Wan's feed-forward too).
    ("tiny-wan", 8): (52_128, 11_264, (64, 9, 435_008, 17_216, 26_112, 5_685_248)),
}


def trace_figures(spec) -> tuple:
    assert spec.activation_trace is not None
    return tuple(getattr(spec.activation_trace, name) for name in TRACE_FIELDS)


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_catalog_unet_flux_and_wan_traces_are_unchanged(spec_of, name):
    params, trace = CATALOG[name]
    spec = spec_of(name)
    assert spec.total_params == params
    assert trace_figures(spec) == trace


@pytest.mark.parametrize("name", sorted(PLANS))
def test_catalog_unet_flux_and_wan_plans_are_unchanged(spec_of, name):
    (stage, checkpointing, micro_batch), per_gpu, per_node = PLANS[name]
    result = recommend(spec_of(name), parse_hardware("8x80GB", "512GB"), global_batch=None, seq_len=2048, margin=0.1)
    best = result.best
    assert (best.choice.zero_stage, best.choice.gradient_checkpointing, best.choice.micro_batch_size) == (stage, checkpointing, micro_batch)
    assert (best.per_gpu_bytes, best.per_node_bytes) == (per_gpu, per_node)


@pytest.mark.parametrize("preset,lora", sorted(TINY, key=str))
def test_tiny_unet_flux_and_wan_traces_are_unchanged(preset, lora):
    total, trainable, trace = TINY[(preset, lora)]
    model = {"config": {"pipeline": preset}, **({"lora": {"r": lora}} if lora else {})}
    data = {"synthetic": {"task": "shapes"}, "images": {"resolution": 64, "bucket_step": 16}, "video": {"frame_buckets": [1, 9]}}
    spec = diffusion_config_spec(RunConfig.model_validate({"model": model, "data": data}))
    assert (spec.total_params, spec.trainable_params) == (total, trainable)
    assert trace_figures(spec) == trace
