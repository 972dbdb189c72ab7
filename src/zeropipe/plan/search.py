"""The recommendation: try every combination, keep those that fit with a margin, pick the cheapest.

The space is small (ZeRO stage x offload x checkpointing x micro-batch x precision, a few
hundred points), so it is searched exhaustively and every point is kept: the table of what
fits and why the rest does not comes from the same evaluations as the answer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import yaml

from zeropipe.doctor.facts import cpu_precision
from zeropipe.errors import ZeroPipeError
from zeropipe.plan.cost import caching_pass_seconds, offload_param_measured, relative_cost, speeds_for, step_seconds
from zeropipe.plan.hardware import GIB, Hardware, format_gib, supports_bf16
from zeropipe.plan.memory import Choice, Term, peak_bytes
from zeropipe.plan.totals import per_gpu_terms, per_node_terms
from zeropipe.plan.model_spec import ModelSpec
from zeropipe.plan.variants import (
    Setting,
    Shape,
    base_settings,
    cache_settings,
    lora_target_settings,
    sequence_parallel_settings,
    shape_grid,
    shape_setting,
    smaller_shapes,
    with_shape,
)

# Knobs that change no result: the search may pick them. Knobs that change the result: only offered.
EXACT_KNOBS = (
    "zero_stage", "offload_optimizer", "offload_param", "gradient_checkpointing", "activation_offload",
    "micro_batch_size", "gradient_accumulation_steps", "data.cache.latents", "data.cache.text", "sequence_parallel",
)
OFFERED_KNOBS = ("model.quantization (fp8, nf4)", "model.lora.target_modules (narrower)", "data.images.resolution", "data.video.frame_buckets")

# Without a global batch, plan for this many examples per rank per optimizer step: candidates
# must be compared at equal work, and accumulation is how few-GPU users reach a useful batch.
DEFAULT_EXAMPLES_PER_RANK = 16
MAX_MICRO_BATCH = 64

# Choice fields a caller may hold fixed, as the run config names them.
KNOBS = (
    "zero_stage",
    "offload_optimizer",
    "offload_param",
    "precision",
    "gradient_checkpointing",
    "micro_batch_size",
    "gradient_accumulation_steps",
    "sequence_parallel",  # parallel.sequence_parallel_size: groups of N ranks share each sample; the batch is dealt over world / N
)
# Activation offload (train.activation_offload) is a Choice field where the memory model has its term.
ACTIVATION_OFFLOAD = "activation_offload" in {f.name for f in dataclasses.fields(Choice)}
if ACTIVATION_OFFLOAD:
    KNOBS += ("activation_offload",)


@dataclass
class Candidate:
    """One evaluated combination."""

    choice: Choice
    per_gpu_terms: list[Term]
    per_node_terms: list[Term]
    per_gpu_bytes: int
    per_node_bytes: int
    relative_cost: float
    fits: bool
    why_not: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    def to_dict(self, terms: bool = False) -> dict[str, Any]:
        row: dict[str, Any] = {
            "choice": vars(self.choice) | {},
            "per_gpu_bytes": self.per_gpu_bytes,
            "per_node_bytes": self.per_node_bytes,
            "relative_cost": round(self.relative_cost, 4),
            "fits": self.fits,
            "why_not": self.why_not,
        }
        if terms:
            row["per_gpu_terms"] = [vars(t) | {} for t in self.per_gpu_terms]
            row["per_node_terms"] = [vars(t) | {} for t in self.per_node_terms]
            row["seconds"] = {k: round(v, 6) for k, v in self.seconds.items()}
        return row


@dataclass
class PlanResult:
    """The search's answer (``best``), everything it tried, and the run config's own choice when there is one."""

    spec: ModelSpec
    hardware: Hardware
    margin: float
    global_batch: int | None
    candidates: list[Candidate]
    best: Candidate | None
    configured: Candidate | None = None
    reason: str | None = None  # why nothing fits, when best is None
    notes: list[str] = field(default_factory=list)
    # The model-level search (search()): exact settings applied to reach ``best`` (caches), changes that
    # would make it fit with their price (``offers``, cheapest in quality first), the largest image or clip
    # that fits with the recommended settings, and the nearest box that fits when no change does.
    settings: tuple[Setting, ...] = ()
    offers: list[Offer] = field(default_factory=list)
    largest_shape: tuple[Shape, ...] = ()  # the largest resolution at the planned frames, and (video) the most frames at the planned resolution
    nearest_box: str | None = None
    # The same per sequence-parallel degree the model and ranks allow (1: none), with the plan's other settings.
    largest_shape_by_degree: dict[int, tuple[Shape, ...]] = field(default_factory=dict)

    @property
    def runnable(self) -> bool:
        """A plan fits this box: as recommended, or with an offered change (exit status 0)."""
        return self.best is not None or bool(self.offers)

    @property
    def usable_gpu_bytes(self) -> int:
        return int(self.hardware.gpu_memory_bytes * (1 - self.margin))

    @property
    def usable_host_bytes(self) -> int:
        return int(self.hardware.host_ram_bytes * (1 - self.margin))

    def require_best(self) -> Candidate:
        """The recommendation, or ZeroPipeError with the reason nothing fits."""
        if self.best is None:
            raise ZeroPipeError(self.reason or "no combination fits this hardware")
        return self.best

    def fragment(self) -> dict[str, dict[str, Any]]:
        """The recommended settings as run-config sections."""
        choice = self.require_best().choice
        return {
            "deepspeed": {
                "zero_stage": choice.zero_stage,
                "offload_optimizer": "cpu" if choice.offload_optimizer else "none",
                "offload_param": "cpu" if choice.offload_param else "none",
                "precision": choice.precision,
            },
            "model": {"gradient_checkpointing": choice.gradient_checkpointing},
            "train": {"micro_batch_size": choice.micro_batch_size, "gradient_accumulation_steps": choice.gradient_accumulation_steps}
            | ({"activation_offload": True} if getattr(choice, "activation_offload", False) else {}),
        } | ({"parallel": {"sequence_parallel_size": choice.sequence_parallel}} if choice.sequence_parallel > 1 else {})

    def yaml_fragment(self) -> str:
        return yaml.safe_dump(self.fragment(), sort_keys=False)

    def summary(self) -> list[Candidate]:
        """One candidate per (stage, offload, checkpointing, precision): its cheapest fitting variant, else its smallest."""
        groups: dict[tuple, list[Candidate]] = {}
        for candidate in self.candidates:
            c = candidate.choice
            groups.setdefault((c.zero_stage, c.offload_optimizer, c.offload_param, c.gradient_checkpointing, c.precision), []).append(candidate)
        rows = []
        for members in groups.values():
            fitting = [m for m in members if m.fits]
            rows.append(min(fitting, key=_rank) if fitting else min(members, key=lambda m: (m.per_gpu_bytes, m.per_node_bytes)))
        return sorted(rows, key=lambda m: (not m.fits, m.relative_cost if m.fits else 0, m.per_gpu_bytes))

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.spec.to_dict(),
            "hardware": {
                "gpus_per_node": self.hardware.gpus_per_node,
                "gpu_memory_bytes": self.hardware.gpu_memory_bytes,
                "nodes": self.hardware.nodes,
                "host_ram_bytes": self.hardware.host_ram_bytes,
                "gpu_name": self.hardware.gpu_name,
                "accelerator": self.hardware.accelerator,
                "cpu_bf16_native": self.hardware.cpu_bf16_native if self.hardware.accelerator == "cpu" else None,
                "notes": list(self.hardware.notes),
            },
            "margin": self.margin,
            "usable_gpu_bytes": self.usable_gpu_bytes,
            "usable_host_bytes": self.usable_host_bytes,
            "global_batch": self.global_batch,
            "best": None if self.best is None else self.best.to_dict(terms=True),
            "configured": None if self.configured is None else self.configured.to_dict(terms=True),
            "fragment": self.fragment() if self.best is not None else None,
            "reason": self.reason,
            "notes": list(self.notes),
            "summary": [c.to_dict() for c in self.summary()],
            "candidates": [c.to_dict() for c in self.candidates],
            "runnable": self.runnable,
            "exact_knobs": list(EXACT_KNOBS),
            "offered_knobs": list(OFFERED_KNOBS),
            "settings": [s.to_dict() for s in self.settings],
            "offers": [o.to_dict() for o in self.offers],
            "largest_shape": [vars(s) for s in self.largest_shape],
            "largest_shape_by_degree": {str(d): [vars(s) for s in shapes] for d, shapes in self.largest_shape_by_degree.items()},
            "nearest_box": self.nearest_box,
        }


@dataclass
class Offer:
    """A change that changes the result (an fp8/nf4 base, a smaller image or clip) and makes the run fit, with its price."""

    settings: tuple[Setting, ...]
    candidate: Candidate
    spec: ModelSpec

    @property
    def rank(self) -> float:
        return sum(s.rank for s in self.settings)

    @property
    def keys(self) -> str:
        return "; ".join(s.key for s in self.settings)

    def describe(self) -> str:
        prices = "; ".join(s.price for s in self.settings)
        c = self.candidate
        return (
            f"fits if you set {self.keys} (price: {prices}): then {c.choice.describe()}, "
            f"{_gib(c.per_gpu_bytes)} per GPU, {_gib(c.per_node_bytes)} host RAM, relative cost {c.relative_cost:.2f}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "settings": [s.to_dict() for s in self.settings],
            "keys": self.keys,
            "rank": round(self.rank, 4),
            "candidate": self.candidate.to_dict(terms=True),
        }


def _rank(candidate: Candidate) -> tuple:
    # Cheapest first; among equals the one leaving more memory free.
    return (round(candidate.relative_cost, 6), candidate.per_gpu_bytes, candidate.per_node_bytes)


def evaluate(spec: ModelSpec, hardware: Hardware, choice: Choice, margin: float = 0.1) -> Candidate:
    """Memory terms, peaks, cost and verdict of one combination."""
    gpu_terms = per_gpu_terms(spec, hardware, choice)
    gpu_peak = peak_bytes(gpu_terms)
    node_terms = per_node_terms(spec, hardware, choice, per_gpu_peak=gpu_peak)
    node_peak = peak_bytes(node_terms)
    usable_gpu = hardware.gpu_memory_bytes * (1 - margin)
    usable_host = hardware.host_ram_bytes * (1 - margin)
    problems = []
    if gpu_peak > usable_gpu:
        biggest = max(gpu_terms, key=lambda t: t.bytes)
        problems.append(
            f"{_gib(gpu_peak)} per GPU > {_gib(usable_gpu)} ({format_gib(hardware.gpu_memory_bytes)} less the {margin:.0%} margin); "
            f"largest term: {biggest.name} {_gib(biggest.bytes)}"
        )
    if node_peak > usable_host:
        biggest = max(node_terms, key=lambda t: t.bytes)
        problems.append(
            f"{_gib(node_peak)} host RAM > {_gib(usable_host)} ({format_gib(hardware.host_ram_bytes)} less the {margin:.0%} margin); "
            f"largest term: {biggest.name} {_gib(biggest.bytes)}"
        )
    why_not = f"{_label(choice)}: " + "; ".join(problems) if problems else None
    return Candidate(
        choice=choice,
        per_gpu_terms=gpu_terms,
        per_node_terms=node_terms,
        per_gpu_bytes=gpu_peak,
        per_node_bytes=node_peak,
        relative_cost=relative_cost(spec, hardware, choice),
        fits=not problems,
        why_not=why_not,
        seconds=step_seconds(spec, hardware, choice),
    )


def batch_shapes(hardware: Hardware, global_batch: int | None, sequence_parallel: int = 1) -> list[tuple[int, int]]:
    """(micro-batch, accumulation) pairs giving the global batch on this many ranks (data-parallel ranks: world / sequence_parallel).

    Raises:
        ZeroPipeError: when the global batch is not a multiple of the number of ranks.
    """
    ranks = hardware.world_size // sequence_parallel
    if global_batch is None:
        global_batch = DEFAULT_EXAMPLES_PER_RANK * ranks
    if global_batch < ranks or global_batch % ranks:
        below, above = max(ranks, global_batch // ranks * ranks), (global_batch // ranks + 1) * ranks
        raise ZeroPipeError(
            f"global batch {global_batch} is not a multiple of the {ranks} ranks (micro-batch x accumulation x ranks): use {below} or {above}"
        )
    per_rank = global_batch // ranks
    return [(micro, per_rank // micro) for micro in range(1, min(per_rank, MAX_MICRO_BATCH) + 1) if per_rank % micro == 0]


# (offload_optimizer, offload_param) pairs each ZeRO stage supports.
OFFLOADS = {
    0: [(False, False)],
    1: [(False, False), (True, False)],
    2: [(False, False), (True, False)],
    3: [(False, False), (True, False), (False, True), (True, True)],
}


def hardware_options(hardware: Hardware, fixed: dict[str, Any]) -> tuple[list[str], dict[int, list[tuple[bool, bool]]]]:
    """The precisions and the offloads (by ZeRO stage) worth trying on this hardware; a knob in ``fixed`` is tried as held.

    GPUs: 16-bit (bf16, else fp16 on cards without it) and fp32, every offload. CPU ranks:
    bf16 only where the CPU runs it natively (emulated, it is 18-56x slower than fp32; DeepSpeed
    has no fp16 there), and no offload: a CPU rank's "GPU" memory is host RAM already, so
    offloading moves bytes from host RAM to host RAM and adds copies.
    """
    if hardware.accelerator == "cpu":
        precisions = ["bf16", "fp32"] if hardware.cpu_bf16_native else ["fp32"]
        held = (bool(fixed.get("offload_optimizer", False)), bool(fixed.get("offload_param", False)))
        offloads = {stage: [pair for pair in pairs if pair in ((False, False), held)] for stage, pairs in OFFLOADS.items()}
    else:
        precisions = ["bf16" if supports_bf16(hardware) else "fp16", "fp32"]
        offloads = OFFLOADS
    if fixed.get("precision") is not None and fixed["precision"] not in precisions:
        precisions.append(fixed["precision"])  # the caller's own choice is judged, even one this search would not make
    return precisions, offloads


def candidate_choices(
    hardware: Hardware,
    global_batch: int | None = None,
    seq_len: int = 2048,
    attention: str = "sdpa",
    fixed: dict[str, Any] | None = None,
    zero3_limits: dict[str, int] | None = None,
    stages: tuple[int, ...] | None = None,
) -> list[Choice]:
    """Every combination the search tries; ``fixed`` holds knobs the caller does not let it change; ``stages`` limits the ZeRO stages (a setting that allows only some)."""
    fixed = dict(fixed or {})
    unknown = set(fixed) - set(KNOBS)
    if unknown:
        raise ValueError(f"unknown knobs {sorted(unknown)}; known: {KNOBS}")
    precisions, offloads = hardware_options(hardware, fixed)
    sp = int(fixed.get("sequence_parallel", 1))
    shapes = batch_shapes(hardware, global_batch, sp)
    if "micro_batch_size" in fixed or "gradient_accumulation_steps" in fixed:
        micro = fixed.get("micro_batch_size")
        accumulation = fixed.get("gradient_accumulation_steps")
        if micro is not None and accumulation is not None:
            shapes = [(micro, accumulation)]
        else:
            shapes = [(m, a) for m, a in shapes if (micro is None or m == micro) and (accumulation is None or a == accumulation)]
            if not shapes:
                # The other knob is free: fill it from the global batch if there is one, else 1.
                per_rank = (global_batch // (hardware.world_size // sp)) if global_batch else None
                if micro is not None:
                    shapes = [(micro, max(1, per_rank // micro) if per_rank else 1)]
                else:
                    shapes = [(max(1, per_rank // accumulation) if per_rank else 1, accumulation)]
    choices = []
    for stage in stages or range(4):
        for offload_optimizer, offload_param in offloads[stage]:
            for checkpointing in (False, True):
                # Activation offload moves the checkpointed block inputs to host RAM: with checkpointing, on GPUs.
                act_offloads = (False, True) if ACTIVATION_OFFLOAD and checkpointing and hardware.accelerator != "cpu" else (False,)
                if ACTIVATION_OFFLOAD and fixed.get("activation_offload"):
                    act_offloads = (True,)
                for act_offload in act_offloads:
                    extra = {"activation_offload": act_offload} if ACTIVATION_OFFLOAD else {}
                    for precision in precisions:
                        for micro, accumulation in shapes:
                            choice = Choice(
                                zero_stage=stage,
                                offload_optimizer=offload_optimizer,
                                offload_param=offload_param,
                                precision=precision,
                                gradient_checkpointing=checkpointing,
                                micro_batch_size=micro,
                                gradient_accumulation_steps=accumulation,
                                seq_len=seq_len,
                                attention=attention,
                                sequence_parallel=sp,
                                **extra,
                                **(zero3_limits or {}),
                            )
                            if all(getattr(choice, knob) == value for knob, value in fixed.items()):
                                choices.append(choice)
    return choices


def recommend(
    spec: ModelSpec,
    hardware: Hardware,
    global_batch: int | None = None,
    seq_len: int = 2048,
    margin: float = 0.1,
    fixed: dict[str, Any] | None = None,
    attention: str = "sdpa",
    zero3_limits: dict[str, int] | None = None,
    stages: tuple[int, ...] | None = None,
) -> PlanResult:
    """The fastest combination that fits in (1 - margin) of GPU memory and of host RAM.

    Args:
        global_batch: examples per optimizer step over all ranks; None plans for
            DEFAULT_EXAMPLES_PER_RANK per rank (and says so in the notes).
        fixed: knobs held at the given values (e.g. ``{"zero_stage": 3}``), by Choice field name.
        zero3_limits: the run's stage3_max_live_parameters / stage3_max_reuse_distance, by Choice field name.

    Raises:
        ZeroPipeError: when the global batch does not divide over the ranks.
    """
    notes = []
    if global_batch is None and not (fixed and "micro_batch_size" in fixed and "gradient_accumulation_steps" in fixed):
        global_batch = DEFAULT_EXAMPLES_PER_RANK * hardware.world_size
        notes.append(
            f"no global batch given: planned for {global_batch} examples per step ({DEFAULT_EXAMPLES_PER_RANK} per GPU); set it with --global-batch"
        )
    choices = candidate_choices(hardware, global_batch, seq_len, attention, fixed, zero3_limits, stages)
    candidates = [evaluate(spec, hardware, choice, margin) for choice in choices]
    fitting = [c for c in candidates if c.fits]
    best = min(fitting, key=_rank) if fitting else None
    speeds = speeds_for(hardware)
    if best is not None and best.choice.offload_param and not offload_param_measured(hardware, speeds):
        without = [c for c in fitting if not c.choice.offload_param]
        if without:
            cheaper = best
            best = min(without, key=_rank)
            notes.append(
                f"the cost model rates {_label(cheaper.choice)} faster ({cheaper.relative_cost:.2f} vs {best.relative_cost:.2f}), but parameter offload's "
                "host link has not been measured on this machine (zeropipe calibrate on the GPUs does): a setting without it that fits is planned instead"
            )
    notes.append(f"speeds: {speeds.source}" + ("" if speeds.measured else "; zeropipe calibrate measures this machine"))
    result = PlanResult(spec, hardware, margin, global_batch, candidates, best, notes=notes)
    if best is None:
        result.reason = _nothing_fits(result, fixed)
    if spec.family == "unknown":
        result.notes.append("a bare parameter count has no shape: activations are left out, so leave room for them")
    if spec.activation_trace is not None:
        result.notes.append(
            f"diffusion activations are for {spec.activation_trace.resolution}x{spec.activation_trace.resolution} px images; --seq-len does not apply"
        )
    if hardware.accelerator == "cpu":
        result.notes += cpu_rank_notes(hardware, fixed or {})
    return result


def search(
    spec: ModelSpec,
    hardware: Hardware,
    global_batch: int | None = None,
    seq_len: int = 2048,
    margin: float = 0.1,
    fixed: dict[str, Any] | None = None,
    attention: str = "sdpa",
    zero3_limits: dict[str, int] | None = None,
    offer: bool = True,
) -> PlanResult:
    """``recommend`` over the model-level knobs too: exact ones picked, result-changing ones offered.

    1. The spec as given (a catalog plan passes the default config's: caches on).
    2. When nothing fits: the exact model-level settings (caching latents and text), picked if they fit.
    3. When still nothing fits: every offered change (an fp8 or nf4 base, a smaller image or clip, and
       their combinations) searched as in 1, each kept with its price, cheapest in quality first.
    4. When no change fits: the nearest box (more RAM, more or larger GPUs, more nodes) that would.
    Image and video plans also get the largest shape that fits with the recommended settings.
    """
    kwargs = dict(global_batch=global_batch, seq_len=seq_len, margin=margin, fixed=fixed, attention=attention, zero3_limits=zero3_limits)
    return complete(recommend(spec, hardware, **kwargs), kwargs, offer)


def complete(result: PlanResult, kwargs: dict[str, Any], offer: bool = True) -> PlanResult:
    """Steps 2-4 of ``search`` and the largest shape, on a plan already made (``recommend``'s or a run config's) with the same arguments."""
    spec, hardware, margin = result.spec, result.hardware, result.margin
    configured, notes = result.configured, result.notes
    degrees = {c.choice.sequence_parallel for c in result.candidates}
    if len(degrees) == 1 and min(degrees) > 1:  # the run config holds a sequence-parallel degree: the rest of the search keeps it
        kwargs = {**kwargs, "fixed": {**(kwargs.get("fixed") or {}), "sequence_parallel": min(degrees)}}
    settings: tuple[Setting, ...] = ()
    if result.best is None:
        for setting, other in cache_settings(spec):
            cached = recommend(other, hardware, **kwargs)
            if cached.best is not None:
                per_example = caching_pass_seconds(other, 1, speeds_for(hardware))
                cached.notes = notes + [
                    f"picked {setting.key} (changes no result; {setting.price}: about {per_example * 1000:.0f} ms per example for the "
                    f"encoders' forward at the plan's speeds, once): without it {result.reason}"
                ]
                cached.configured = configured
                result, settings = cached, (setting,)
                break
            spec, settings = other, (setting,)  # the offers below start from the cached run
    if result.best is None and "sequence_parallel" not in (kwargs.get("fixed") or {}):
        # Sequence parallelism (exact; its price is the all-to-all time): the smallest degree that fits, on the spec reached so far.
        for setting in sequence_parallel_settings(spec, hardware.world_size):
            split = recommend(spec, hardware, **{**kwargs, "fixed": {**(kwargs.get("fixed") or {}), "sequence_parallel": setting.value}})
            if split.best is not None:
                split.notes = notes + [f"picked {setting.key} (changes no result; {setting.price}): without it {result.reason}"]
                split.configured = configured
                result, settings = split, settings + (setting,)
                break
    result.settings = settings
    if result.best is None and offer:
        result.offers = offers_for(spec, hardware, kwargs, settings)
    plan_spec, plan_choice = (result.spec, result.best.choice) if result.best is not None else (
        (result.offers[0].spec, result.offers[0].candidate.choice) if result.offers else (None, None)
    )
    if plan_spec is not None and plan_spec.activation_trace is not None:
        result.largest_shape = largest_shape(plan_spec, hardware, plan_choice, margin)
        degrees = [s.value for s in sequence_parallel_settings(plan_spec, hardware.world_size)]
        if degrees:
            result.largest_shape_by_degree = {
                d: largest_shape(plan_spec, hardware, dataclasses.replace(plan_choice, sequence_parallel=d), margin) for d in [1, *degrees]
            }
    if not result.runnable and offer:
        result.nearest_box = nearest_box(spec, hardware, kwargs)
    return result


def _fits(spec: ModelSpec, hardware: Hardware, kwargs: dict[str, Any], stages) -> PlanResult | None:
    r = recommend(spec, hardware, **kwargs, stages=stages)
    return r if r.best is not None else None


def offers_for(spec: ModelSpec, hardware: Hardware, kwargs: dict[str, Any], settings: tuple[Setting, ...] = ()) -> list[Offer]:
    """The changes the planner knows that make this run fit, cheapest in quality first (each with its best settings)."""
    from zeropipe.plan.variants import stages_for

    offers: list[Offer] = []
    changes = base_settings(spec) + lora_target_settings(spec)
    bases: list[tuple[tuple[Setting, ...], ModelSpec]] = [((), spec)] + [((setting,), other) for setting, other in changes]
    for base_settings_, base_spec in bases:
        stages = stages_for({s.knob: s.value for s in base_settings_}, spec)
        if base_settings_:
            fit = _fits(base_spec, hardware, kwargs, stages)
            if fit is not None:
                offers.append(Offer(settings + base_settings_, fit.best, base_spec))
                continue  # a smaller shape on top of a base that fits already is no smaller change
        if base_spec.activation_trace is None:
            continue
        for shape in _shape_offers(base_spec, hardware, kwargs, stages):
            fit = _fits(with_shape(base_spec, shape), hardware, kwargs, stages) if shape is not None else None
            if fit is not None:
                offers.append(Offer(settings + base_settings_ + (shape_setting(base_spec, shape),), fit.best, fit.spec))
    # One offer per set of keys, cheapest in quality first, then in time.
    seen, unique = set(), []
    for o in sorted(offers, key=lambda o: (o.rank, o.candidate.relative_cost)):
        if o.keys not in seen:
            seen.add(o.keys)
            unique.append(o)
    return unique


def _shape_offers(spec: ModelSpec, hardware: Hardware, kwargs: dict[str, Any], stages):
    """Per kind of shape change, the list of smaller shapes to try (largest first): lower resolution at the traced frames, and for video fewer frames at the traced resolution."""
    trace = spec.activation_trace
    smaller = smaller_shapes(spec)
    kinds = [[s for s in smaller if s.frames == trace.frames]]
    if trace.frames > 1:
        kinds.append([s for s in smaller if s.resolution == trace.resolution])
    for shapes in kinds:
        yield _largest_fitting(spec, shapes, hardware, kwargs, stages)


def _largest_fitting(spec: ModelSpec, shapes: list[Shape], hardware: Hardware, kwargs: dict[str, Any], stages) -> Shape | None:
    """The largest of ``shapes`` whose plan fits, by bisection (memory grows with the activations' scale)."""
    from zeropipe.plan.variants import shape_scale

    ordered = sorted(shapes, key=lambda s: (shape_scale(spec, s), s.resolution), reverse=True)
    low, high, found = 0, len(ordered) - 1, None
    while low <= high:
        mid = (low + high) // 2
        if _fits(with_shape(spec, ordered[mid]), hardware, kwargs, stages) is not None:
            found, high = ordered[mid], mid - 1
        else:
            low = mid + 1
    return found


def largest_shape(spec: ModelSpec, hardware: Hardware, choice: Choice, margin: float) -> tuple[Shape, ...]:
    """With ``choice``'s settings at micro-batch 1 (its ZeRO, offload and checkpointing held): the largest resolution at the
    planned frame count and, for video, the most frames at the planned resolution (up to twice each)."""
    from zeropipe.plan.variants import shape_scale

    lean = dataclasses.replace(choice, micro_batch_size=1, gradient_accumulation_steps=choice.micro_batch_size * choice.gradient_accumulation_steps)
    trace = spec.activation_trace
    grid = shape_grid(spec, up_to=2.0)
    kinds = [[s for s in grid if s.frames == trace.frames]]
    if trace.frames > 1:
        kinds.append([s for s in grid if s.resolution == trace.resolution])
    found_all = []
    for shapes in kinds:
        ordered = sorted(shapes, key=lambda s: (shape_scale(spec, s), s.resolution), reverse=True)
        low, high, found = 0, len(ordered) - 1, None
        while low <= high:
            mid = (low + high) // 2
            if evaluate(with_shape(spec, ordered[mid]), hardware, lean, margin).fits:
                found, high = ordered[mid], mid - 1
            else:
                low = mid + 1
        if found is not None and found not in found_all:
            found_all.append(found)
    return tuple(found_all)


# Boxes tried when no change fits, nearest first: more RAM, more GPUs, larger GPUs, more nodes.
def nearest_box(spec: ModelSpec, hardware: Hardware, kwargs: dict[str, Any]) -> str | None:
    """The nearest box on which the run as planned (exact settings only) fits, described as --gpus/--ram/--nodes."""
    gib = GIB
    if hardware.accelerator == "cpu":
        # CPU ranks: a rank's "GPU" memory is its share of the RAM, so only more RAM (or fewer ranks sharing it) helps.
        for factor in (2, 4, 8, 16):
            ram = hardware.host_ram_bytes * factor
            for ranks in sorted({hardware.gpus_per_node, 1}, reverse=True):
                box = dataclasses.replace(hardware, gpus_per_node=ranks, gpu_memory_bytes=ram // ranks, host_ram_bytes=ram)
                try:
                    r = recommend(spec, box, **dict(kwargs, global_batch=None))
                except ZeroPipeError:
                    continue
                if r.best is not None:
                    return f"--cpu-ranks {ranks} --ram {ram / gib:.0f}GB: {r.best.choice.describe()}, {_gib(r.best.per_node_bytes)} host RAM"
        return None
    boxes = []
    for factor in (2, 4, 8):
        boxes.append(dataclasses.replace(hardware, host_ram_bytes=hardware.host_ram_bytes * factor))
    for count in range(hardware.gpus_per_node + 1, 9):
        boxes.append(dataclasses.replace(hardware, gpus_per_node=count))
    for size in (32, 48, 80, 96, 141):
        if size * gib > hardware.gpu_memory_bytes:
            for factor in (1, 2, 4):
                boxes.append(dataclasses.replace(hardware, gpu_memory_bytes=size * gib, host_ram_bytes=hardware.host_ram_bytes * factor))
    for nodes in (2, 4, 8):
        boxes.append(dataclasses.replace(hardware, nodes=nodes))
    batch = kwargs.get("global_batch")
    for box in boxes:
        try:
            args = dict(kwargs, global_batch=None if batch is None or batch % box.world_size else batch)
            r = recommend(spec, box, **args)
        except ZeroPipeError:
            continue
        if r.best is not None:
            return (
                f"--gpus {box.gpus_per_node}x{box.gpu_memory_bytes / gib:.0f}GB --ram {box.host_ram_bytes / gib:.0f}GB --nodes {box.nodes}: "
                f"{r.best.choice.describe()}, {_gib(r.best.per_gpu_bytes)} per GPU, {_gib(r.best.per_node_bytes)} host RAM per node"
            )
    return None


def cpu_rank_notes(hardware: Hardware, fixed: dict[str, Any]) -> list[str]:
    """What the search on CPU ranks tried and why: the same RAM for both budgets, the precision by the CPU's flags, no offload."""
    precision, why = cpu_precision(hardware.cpu_bf16_native)
    notes = ["CPU ranks: the 'GPU memory' of a rank is its share of host RAM, and both budgets are the same RAM"]
    held = fixed.get("precision")
    if held is not None and held != "fp32" and not hardware.cpu_bf16_native:
        notes.append(f"CPU ranks: precision {held} as set, although {why}")
    elif held is None:
        tried = "bf16 and fp32" if precision == "bf16" else "fp32 only"
        notes.append(f"CPU ranks: {tried} tried, as precision: auto picks here: {why}")
    if not (fixed.get("offload_optimizer") or fixed.get("offload_param")):
        notes.append("CPU ranks: no offload tried: a rank's 'GPU' memory is host RAM already, so offloading would move bytes from host RAM to host RAM and add copies")
    return notes


def _nothing_fits(result: PlanResult, fixed: dict[str, Any] | None) -> str:
    usable_gpu, usable_host = result.usable_gpu_bytes, result.usable_host_bytes
    candidates = result.candidates
    held = f" with {', '.join(f'{k}={v}' for k, v in fixed.items())} held fixed" if fixed else ""
    on_gpus = [c for c in candidates if c.per_gpu_bytes <= usable_gpu]
    in_ram = [c for c in candidates if c.per_node_bytes <= usable_host]
    lora = "" if result.spec.lora is not None or result.spec.family == "unknown" else ", or LoRA (--lora-r 16)"
    if not on_gpus:
        smallest = min(candidates, key=lambda c: c.per_gpu_bytes)
        return (
            f"nothing fits{held}: even the combination that needs the least GPU memory ({smallest.choice.describe()}) needs "
            f"{_gib(smallest.per_gpu_bytes)} per GPU, and {_gib(usable_gpu)} is usable. "
            f"Options: more or larger GPUs, a shorter sequence or smaller images{lora}"
        )
    if not in_ram:
        smallest = min(candidates, key=lambda c: c.per_node_bytes)
        return (
            f"nothing fits{held}: even the combination that needs the least host RAM ({smallest.choice.describe()}) needs "
            f"{_gib(smallest.per_node_bytes)} per node, and {_gib(usable_host)} is usable. Options: more host RAM, more nodes{lora}"
        )
    gpu_side = min(on_gpus, key=lambda c: c.per_node_bytes)
    ram_side = min(in_ram, key=lambda c: c.per_gpu_bytes)
    return (
        f"nothing fits{held}: what fits on the GPUs needs too much host RAM (at least {_gib(gpu_side.per_node_bytes)} of "
        f"{_gib(usable_host)} usable, with {gpu_side.choice.describe()}), and what fits in host RAM needs too much GPU memory "
        f"(at least {_gib(ram_side.per_gpu_bytes)} of {_gib(usable_gpu)} usable, with {ram_side.choice.describe()}). "
        f"Options: more host RAM (for offloading), more or larger GPUs{lora}"
    )


def _label(choice: Choice) -> str:
    offload = "+".join(name for name, on in (("optimizer", choice.offload_optimizer), ("params", choice.offload_param)) if on)
    label = f"ZeRO-{choice.zero_stage}"
    if offload:
        label += f" offload {offload}"
    if choice.gradient_checkpointing:
        label += " checkpointing"
    return f"{label} micro-batch {choice.micro_batch_size}"


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.1f} GiB"


__all__ = ["Candidate", "Offer", "PlanResult", "batch_shapes", "candidate_choices", "evaluate", "hardware_options", "recommend", "search"]
