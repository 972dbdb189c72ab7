"""Ulysses sequence parallelism for diffusion transformers, through diffusers' context-parallel plans.

``parallel.sequence_parallel_size: N`` makes groups of N consecutive ranks (0..N-1, N..2N-1, ...,
DeepSpeed's ``parallel_state_sp``, as the causal LM's). Every rank of a group draws the same
micro-batch, caption dropout, flip, noise and timestep (the task seeds its streams by the group,
not the rank), so the group holds one set of inputs. diffusers 0.42's context parallelism
(``ContextParallelConfig``, the denoiser class's ``_cp_plan``) then splits the latent tokens
where the plan says (Wan: the first block's input and the RoPE tables), trades the sequence split
for a split of the heads inside each self-attention (``TemplatedUlyssesAttention``: an all-to-all,
attention over the whole sequence with 1/N of the heads, an all-to-all back; it has a backward),
and gathers the tokens again after the last layer (``proj_out``). Text and other conditions the
plan leaves whole stay whole on every rank; the loss region (a given first frame...) is cut from
the gathered prediction as without the split.

The loss: every rank computes the micro-batch's loss on the gathered prediction, the same value.
diffusers' gather sends back to each rank only its own tokens' part of the gradient, so the
group's gradients add up to those of the one micro-batch; ZeRO-3 divides them by every rank
(its reduce-scatter, as in the causal LM's ``group_loss``), so the loss carries a factor N.

diffusers' ``enable_parallelism`` is not called: it builds its device's index with
``torch.accelerator.device_count()``, 0 on CPU ranks, and its own mesh over the whole world. The
same steps are taken here with a mesh of (data, ring, ulysses) whose ulysses rows are the groups.
Its "anything" variant (heads or tokens that do not divide by N) has no backward in 0.42
(``TemplatedUlyssesAnythingAttention.backward`` raises), so training refuses those instead.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

DATA_AXIS = "data"

# Denoiser classes whose plan gives the unsplit model's output and gradients on a 2-rank group
# (tests/unit/diffusion/test_sequence_parallel.py); the entries of these classes are accepted, and the
# family's spec builder (plan_specs.py) tells the planner their heads, so that it offers the degree for them.
VERIFIED = ("WanTransformer3DModel", "FluxTransformer2DModel", "Flux2Transformer2DModel", "QwenImageTransformer2DModel")
# Classes with a plan in diffusers 0.42 that do not train under it here, and why.
REFUSED = {
    "LTXVideoTransformer3DModel": "diffusers 0.42's LTX attention processor repeats the text mask over all the heads before Ulysses hands each "
    "rank 1/N of them, and the attention then fails (measured: \"output with shape [1, 1, 48, 8] doesn't match the broadcast shape [1, 2, 48, 8]\")",
}


def has_plan(model_class: type) -> bool:
    """Whether diffusers ships a context-parallel plan for this denoiser class."""
    return getattr(model_class, "_cp_plan", None) is not None


def entries_with_plan(verified: bool = True) -> list[str]:
    """The registered architecture entries whose denoiser has a context-parallel plan (import diffusers); ``verified``: of a VERIFIED class."""
    from zeropipe.families.diffusion.entries import architectures

    names = []
    for name, arch in sorted(architectures().items()):
        try:
            cls = arch.model_class()
        except (AttributeError, ImportError):
            continue
        if has_plan(cls) and (not verified or cls.__name__ in VERIFIED):
            names.append(name)
    return names


def working_degrees(heads: int, world_size: int | None = None) -> list[int]:
    """The degrees > 1 that split ``heads`` evenly (and the ranks, when given)."""
    return [d for d in range(2, heads + 1) if heads % d == 0 and (world_size is None or world_size % d == 0)]


def denoiser_heads(arch: Any, config: Any) -> int | None:
    """The configured denoiser's attention heads (``num_attention_heads``), from the inline preset or the pipeline folder; None when unreadable."""
    import inspect

    from zeropipe.config.pipeline_index import read_pipeline_index

    fields: dict[str, Any] = {}
    section = config.model
    try:
        if section.config is not None and "pipeline" in section.config:
            from zeropipe.families.diffusion.pipelines import preset_components

            fields = preset_components(section.config)[1].get(arch.record.denoiser, {})
        elif section.path:
            fields = read_pipeline_index(section.path).component_config(arch.record.denoiser)
    except (OSError, ValueError, Exception):  # noqa: BLE001 - the family's own checks report an unreadable model
        return None
    if "num_attention_heads" in fields:
        return int(fields["num_attention_heads"])
    default = inspect.signature(arch.model_class().__init__).parameters.get("num_attention_heads")
    return int(default.default) if default is not None and isinstance(default.default, int) else None


def run_problems(arch: Any, config: Any, size: int) -> list[tuple[str, str, str]]:
    """``check``'s (key, problem, fix) for a diffusion run with sequence parallelism of degree ``size``."""
    import diffusers

    key, off = "parallel.sequence_parallel_size", "set parallel.sequence_parallel_size: 1"
    if arch is None:
        return []
    cls = arch.model_class()
    name = cls.__name__
    accepted = ", ".join(entries_with_plan())
    if name in REFUSED:
        return [(key, f"the {arch.record.name} entry's denoiser ({name}) does not train with sequence parallelism: {REFUSED[name]}; entries that do: {accepted}", off)]
    if not has_plan(cls):
        return [(key, f"the {arch.record.name} entry's denoiser ({name}) has no context-parallel plan (_cp_plan) in diffusers {diffusers.__version__}, "
                 f"which is how ZeRO-Pipe splits a diffusion model's tokens; entries whose denoiser has one: {accepted}", off)]
    if name not in VERIFIED:
        return [(key, f"the {arch.record.name} entry's denoiser ({name}) has a context-parallel plan that ZeRO-Pipe has not verified against the unsplit "
                 f"model; entries verified: {accepted}", off)]
    heads = denoiser_heads(arch, config)
    if heads is not None and heads % size:
        degrees = working_degrees(heads)
        return [(key, f"Ulysses splits the attention heads over the group: the denoiser's {heads} heads do not split into {size} (diffusers' "
                 "uneven \"ulysses_anything\" attention has no backward in 0.42, so it cannot train)",
                 f"set {key} to one of {', '.join(map(str, degrees)) or '1'}")]
    return []


def enable(model: torch.nn.Module, size: int) -> Any:
    """Put diffusers' Ulysses context parallelism on ``model`` over groups of ``size`` consecutive ranks (a collective).

    Returns:
        diffusers' ``ParallelConfig`` now on the model.
    """
    import torch.distributed as dist
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    rank, world = dist.get_rank(), dist.get_world_size()
    device_type = torch._C._get_accelerator().type
    index = rank % max(torch.accelerator.device_count(), 1) if device_type != "cpu" else None
    device = torch.device(device_type, index) if index is not None else torch.device("cpu")
    # Ranks laid out row-major: the ulysses axis (the last) holds consecutive ranks, DeepSpeed's groups.
    mesh = torch.distributed.device_mesh.init_device_mesh(device_type, (world // size, 1, size), mesh_dim_names=(DATA_AXIS, "ring", "ulysses"))
    context = ContextParallelConfig(ulysses_degree=size, mesh=mesh)
    config = ParallelConfig(context_parallel_config=context)
    config.setup(rank, world, device, mesh=mesh)
    for module in model.modules():
        if isinstance(module, (Attention, AttentionModuleMixin)) and hasattr(getattr(module, "processor", None), "_parallel_config"):
            module.processor._parallel_config = config
    model._parallel_config = config
    apply_context_parallel(model, context, model._cp_plan)
    return config


def enable_for_run(model: torch.nn.Module, trainer: Any):
    """The run's groups: DeepSpeed's (the ``mpu`` deepspeed.initialize takes, which averages gradients over world / N) and diffusers' plan on ``model``."""
    import logging

    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu

    size = trainer.sequence_parallel
    mpu.initialize_sequence_parallel(sequence_parallel_size=size)
    enable(model, size)
    logging.getLogger("zeropipe").info(
        "sequence parallelism: groups of %d ranks share each sample's tokens (diffusers' context-parallel plan of %s, Ulysses over the heads); %d data-parallel ranks",
        size, type(model).__name__, trainer.data_world,
    )
    return mpu


def group_loss(task: Any, compute: Callable[[], torch.Tensor], latents: torch.Tensor, examples: int) -> tuple[torch.Tensor, float, float]:
    """(loss to backpropagate, tokens, examples) of the group's micro-batch on this rank; the group's loss kept as ``task.reported_loss``.

    Every rank of the group computes the same loss (the prediction is gathered whole); the factor N
    makes ZeRO-3's division by every rank a division by the data-parallel ranks. Examples are
    counted on the group's first rank only.
    """
    trainer = task.trainer
    size = trainer.sequence_parallel
    # The group draws alike (one sample, its noise and timestep), but dropout (LoRA's) must not give every rank the
    # same mask over its different tokens: the denoiser runs on a stream of this rank's own, seeded from the run's
    # seed, the rank, the step and the micro-batch (so a resumed run draws the same), and the shared stream is left as it was.
    task.sp_micro = getattr(task, "sp_micro", 0) + 1 if getattr(task, "sp_micro_step", None) == trainer.step else 1
    task.sp_micro_step = trainer.step
    seed = ((task.config.run.seed * 1_000_003 + trainer.step) * 1009 + task.sp_micro) * 4099 + trainer.rank
    devices = [trainer.device] if trainer.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            loss = compute()
    except AssertionError as err:  # diffusers' EquipartitionSharder: a split dimension that does not divide by the group
        if "divisible by mesh size" not in str(err):
            raise
        from zeropipe.errors import ConfigError

        raise ConfigError([("parallel.sequence_parallel_size", f"a micro-batch of latents {tuple(latents.shape)} has a token count (or a text length the "
                            f"plan splits) that does not divide into {size} equal parts over the group: choose data.images.resolution, bucket_step "
                            f"and the frame buckets so that every bucket's tokens divide by {size}, or set a degree that divides them")]) from err
    task.reported_loss = loss.detach().double()
    scale = size if trainer.plan.zero_stage == 3 else 1
    return loss * scale, 0.0, float(examples) if trainer.sp_rank == 0 else 0.0
