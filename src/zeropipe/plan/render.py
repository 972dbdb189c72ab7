"""The plan as text for a terminal: the terms of the chosen combination, the candidates, the YAML."""

from __future__ import annotations

from zeropipe.plan.hardware import GIB
from zeropipe.plan.memory import ALWAYS, Term
from zeropipe.plan.search import Candidate, PlanResult


def render_plan(result: PlanResult) -> str:
    lines: list[str] = []
    spec, hardware = result.spec, result.hardware
    trainable = f"{_count(spec.trainable_params)} trainable" + (f" (LoRA r={spec.lora.r})" if spec.lora else "")
    lines.append(f"zeropipe plan: {spec.name}, {_count(spec.total_params)} parameters, {trainable}")
    if spec.frozen_models:
        lines.append("  frozen models: " + ", ".join(f"{m.name} {_count(m.params)}" for m in spec.frozen_models))
    lines.append(f"  model from {spec.source}")
    lines.append(f"  hardware: {hardware.describe()}")
    lines += [f"    {note}" for note in hardware.notes]
    some = result.configured or result.best or (result.candidates[0] if result.candidates else None)
    if some is not None:
        batch = f"global batch {result.global_batch}" if result.global_batch else "global batch as configured"
        tokens = "" if spec.activation_trace is not None else f"sequence {some.choice.seq_len} tokens, "
        lines.append(f"  {tokens}{batch}, {some.choice.attention} attention, safety margin {result.margin:.0%}")
    lines += [f"  note: {note}" for note in result.notes]
    lines.append("")

    shown: Candidate | None = result.configured or result.best
    if result.configured is not None:
        verdict = "fits" if result.configured.fits else "does NOT fit"
        lines.append(f"Your config: {result.configured.choice.describe()}: {verdict}")
        if result.configured.why_not:
            lines.append(f"  {result.configured.why_not}")
    if result.best is not None:
        lines.append(f"Recommended: {result.best.choice.describe()} (relative cost {result.best.relative_cost:.2f})")
        lines += [f"  with {s.key}: changes no result ({s.price})" for s in result.settings]
    elif result.offers:
        # The change that makes it fit, with its price, before anything else.
        first = result.offers[0]
        lines.append(f"Fits if you set {first.keys}: {first.candidate.choice.describe()} (relative cost {first.candidate.relative_cost:.2f})")
        lines += [f"  price: {s.price}" for s in first.settings if not s.exact]
        lines += [f"  with {s.key}: changes no result ({s.price})" for s in first.settings if s.exact]
        lines.append(f"  as given: {result.reason or 'nothing fits'}")
        if len(result.offers) > 1:
            lines.append("Other changes that fit, cheapest in quality first:")
            lines += [f"  - {o.describe()}" for o in result.offers[1:]]
        if shown is None:
            shown = first.candidate
    else:
        lines.append(result.reason or "nothing fits")
        lines.append("No change the planner knows (caches, an fp8 or nf4 base, a smaller image or clip) makes it fit on this box.")
        if result.nearest_box:
            lines.append(f"Nearest box that fits: {result.nearest_box}")
        if shown is None and result.candidates:
            shown = min(result.candidates, key=lambda c: c.per_gpu_bytes)
            lines.append(f"Closest (least GPU memory): {shown.choice.describe()}")
    if result.largest_shape:
        planned = "the recommended settings" if result.best is not None else "the settings above"
        trace = (result.spec if result.best is not None or not result.offers else result.offers[0].spec).activation_trace
        shapes = [
            s.describe() + (" or more (the largest tried)" if trace is not None and (s.resolution >= 2 * trace.resolution - 63 or s.frames >= 2 * trace.frames - 8 > 1) else "")
            for s in result.largest_shape
        ]
        lines.append(f"Largest that fits with {planned} at micro-batch 1: " + "; ".join(shapes) + " (activations scaled from the trace, an upper bound)")
    for degree, found in result.largest_shape_by_degree.items():
        lines.append(f"  with parallel.sequence_parallel_size: {degree}: " + ("; ".join(s.describe() for s in found) or "nothing of the shapes tried"))
    lines.append("")
    if shown is not None:
        lines += _terms_table(
            f"Per GPU: peak {_gib(shown.per_gpu_bytes)} of {_gib(hardware.gpu_memory_bytes)} ({_gib(result.usable_gpu_bytes)} usable)",
            shown.per_gpu_terms,
        )
        lines.append("")
        lines += _terms_table(
            f"Per node, host RAM: peak {_gib(shown.per_node_bytes)} of {_gib(hardware.host_ram_bytes)} ({_gib(result.usable_host_bytes)} usable)",
            shown.per_node_terms,
        )
        lines.append("")
    lines += _candidates_table(result)
    if result.best is not None:
        lines.append("")
        lines.append("Run-config settings (YAML):")
        lines += ["  " + line for line in result.yaml_fragment().splitlines()]
        lines += [f"  # and {s.key}" for s in result.settings if s.knob != "sequence_parallel"]  # the degree is in the YAML above
    elif result.offers:
        lines.append("")
        lines.append(f"Run-config settings with {result.offers[0].keys} (YAML):")
        lines += ["  " + line for line in yaml_fragment(result.offers[0].candidate).splitlines()]
        lines += [f"  # and {s.key}" for s in result.offers[0].settings]
    return "\n".join(lines) + "\n"


def yaml_fragment(candidate: Candidate) -> str:
    import yaml

    c = candidate.choice
    fragment = {
        "deepspeed": {
            "zero_stage": c.zero_stage,
            "offload_optimizer": "cpu" if c.offload_optimizer else "none",
            "offload_param": "cpu" if c.offload_param else "none",
            "precision": c.precision,
        },
        "model": {"gradient_checkpointing": c.gradient_checkpointing},
        "train": {"micro_batch_size": c.micro_batch_size, "gradient_accumulation_steps": c.gradient_accumulation_steps},
    }
    if getattr(c, "activation_offload", False):
        fragment["train"]["activation_offload"] = True
    if c.sequence_parallel > 1:
        fragment["parallel"] = {"sequence_parallel_size": c.sequence_parallel}
    return yaml.safe_dump(fragment, sort_keys=False)


def _terms_table(title: str, terms: list[Term]) -> list[str]:
    lines = [title]
    width = max(len(t.name) for t in terms)
    for term in terms:
        lines.append(f"  {term.name:<{width}}  {term.bytes / GIB:7.2f} GiB  {term.phase:<16}  {term.explanation}")
    always = sum(t.bytes for t in terms if t.phase == ALWAYS)
    phases: dict[str, int] = {}
    for term in terms:
        if term.phase != ALWAYS:
            phases[term.phase] = phases.get(term.phase, 0) + term.bytes
    if phases:
        largest = max(phases, key=lambda p: phases[p])
        others = ", ".join(f"{p} {_gib(b)}" for p, b in phases.items() if p != largest)
        lines.append(f"  peak = always {_gib(always)} + {largest} {_gib(phases[largest])}" + (f" (the larger phase; {others})" if others else ""))
    return lines


def _candidates_table(result: PlanResult) -> list[str]:
    rows = result.summary()
    if not rows:
        return []
    precision = (result.best or result.configured or rows[0]).choice.precision
    main = [r for r in rows if r.choice.precision == precision]
    lines = [f"Candidates ({precision}; the cheapest variant of each that fits, else its smallest; cost 1.00 = bare forward + backward):"]
    header = f"  {'fits':<4}  {'ZeRO':<4}  {'offload':<16}  {'ckpt':<4}  {'micro x acc':<11}  {'per GPU':>9}  {'host RAM':>9}  {'cost':>6}  why not"
    lines.append(header)
    for row in main:
        c = row.choice
        offload = "+".join(n for n, on in (("optimizer", c.offload_optimizer), ("params", c.offload_param)) if on) or "-"
        cost = f"{row.relative_cost:6.2f}" if row.fits else f"{'':>6}"
        why = "" if row.fits else (row.why_not or "").split(": ", 1)[-1]
        fits, checkpointing = "yes" if row.fits else "no", "yes" if c.gradient_checkpointing else "no"
        shape = f"{c.micro_batch_size} x {c.gradient_accumulation_steps}"
        lines.append(
            f"  {fits:<4}  {c.zero_stage:<4}  {offload:<16}  {checkpointing:<4}  {shape:<11}  "
            f"{_gib(row.per_gpu_bytes):>9}  {_gib(row.per_node_bytes):>9}  {cost}  {why}"
        )
    for other in sorted({r.choice.precision for r in rows} - {precision}):
        fitting = [r for r in rows if r.choice.precision == other and r.fits]
        if fitting:
            best = min(fitting, key=lambda r: r.relative_cost)
            lines.append(f"  {other}: the cheapest fit is {best.choice.describe()} at cost {best.relative_cost:.2f}")
        else:
            lines.append(f"  {other}: nothing fits")
    return lines


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.1f} GiB"


def _count(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    return f"{n:,}"
