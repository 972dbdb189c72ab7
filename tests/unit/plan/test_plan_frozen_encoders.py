"""Frozen encoders with caching off are counted as the ranks load them (issue 31, defect 6).

The ranks load text encoders in the dtype the node's setup process uses
(``models.common.encoder_precision_for``: bf16 where the run is bf16, else fp32, never fp16) and
the VAE in fp32; the planner used to count 2 bytes per weight whatever was loaded.
"""

from __future__ import annotations

from zeropipe.models.common import encoder_precision_for
from zeropipe.plan import parse_hardware
from zeropipe.plan.hardware import GIB
from zeropipe.plan.memory import Choice, frozen_model_bytes
from zeropipe.plan.totals import per_gpu_terms, per_node_terms


def frozen_term(spec, precision):
    hardware = parse_hardware("4x24GB", "64GB")
    terms = per_gpu_terms(spec, hardware, Choice(zero_stage=2, precision=precision, gradient_checkpointing=True))
    (term,) = [t for t in terms if t.name == "frozen models (text encoders, VAE)"]
    return term


def test_flux_encoders_without_caches_are_counted_in_the_dtype_they_are_loaded_in(spec_of):
    spec = spec_of("flux.1-dev")
    encoders = sum(m.params for m in spec.frozen_models if not m.name.startswith("vae"))
    vae = sum(m.params for m in spec.frozen_models if m.name.startswith("vae"))
    # bf16 run: CLIP + T5-XXL in bf16 (as loaded where the device runs bf16), the VAE in fp32.
    bf16 = frozen_term(spec, "bf16")
    assert bf16.bytes == encoders * 2 + vae * 4 and "encoders in bf16, the VAE in fp32" in bf16.explanation
    # fp16 (pre-Ampere GPUs): the encoders are loaded in fp32, never fp16 (T5 overflows): 18+ GiB, not 9.
    fp16 = frozen_term(spec, "fp16")
    assert fp16.bytes == (encoders + vae) * 4 and fp16.bytes > 18 * GIB
    assert encoder_precision_for("cuda", "fp16", "no bf16")[0] == "fp32" and encoder_precision_for("cuda", "bf16", "")[0] == "bf16"


def test_host_ram_while_loading_counts_the_same_bytes_per_rank(spec_of):
    spec = spec_of("sdxl")
    hardware = parse_hardware("4x24GB", "64GB")
    (loading,) = [t for t in per_node_terms(spec, hardware, Choice(zero_stage=2, precision="bf16")) if t.name == "model loading peak"]
    assert loading.bytes == 4 * (spec.total_params * 2 + frozen_model_bytes(spec.frozen_models, "bf16"))


def cached(spec):
    """The spec as a run with its caches on sees it: the encoders are loaded only by the node's setup process."""
    from dataclasses import replace

    return replace(spec, cached_models=spec.frozen_models, frozen_models=())


def test_flux2_text_encoder_is_planned_spread_over_the_node_while_the_caches_fill(spec_of):
    """Mistral Small 3.1 (24B, 44.7 GiB in bf16) cannot sit on one 24 GB GPU: the setup process spreads it (issue 31, defect 3)."""
    spec = cached(spec_of("flux.2-dev"))
    choice = Choice(zero_stage=3, precision="bf16", gradient_checkpointing=True, offload_optimizer=True, offload_param=True)
    five = per_gpu_terms(spec, parse_hardware("5x24GB", "64GB"), choice)
    (setup,) = [t for t in five if t.name == "text encoders while filling the caches (node setup)"]
    assert setup.phase == "cache filling" and "spread over the node's 5 GPUs (8.94 GiB each)" in setup.explanation
    # One GPU: what does not fit there streams from host RAM, which the node's budget counts.
    one = parse_hardware("1x24GB", "64GB")
    (node,) = [t for t in per_node_terms(spec, one, choice) if t.name == "text encoders streamed from host RAM (node setup)"]
    assert 20 * GIB < node.bytes < 30 * GIB


def test_small_text_encoders_stay_on_the_first_gpu(spec_of):
    spec = cached(spec_of("sdxl"))
    (setup,) = [t for t in per_gpu_terms(spec, parse_hardware("4x24GB", "64GB"), Choice(precision="bf16")) if t.name.startswith("text encoders while")]
    assert "on the node's first GPU" in setup.explanation


def test_the_setup_process_spreads_only_what_does_not_fit_on_the_first_gpu():
    from zeropipe.families.diffusion.pipelines import spread_placement

    assert spread_placement(5 * GIB, [23 * GIB] * 5, 60 * GIB) is None
    placement = spread_placement(int(44.7 * GIB), [23 * GIB] * 5, 60 * GIB)
    assert [placement[index] for index in range(5)] == [int(23 * GIB * 0.9)] * 5 and placement["cpu"] == int(60 * GIB * 0.8)
