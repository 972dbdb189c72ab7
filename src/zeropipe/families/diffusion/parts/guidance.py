"""The guidance-preserving objective: LoRA training that keeps a guidance-distilled model's built-in guidance.

A guidance-distilled model (MiniMax-H3, FLUX.1/FLUX.2 [dev]) predicts in one
call what classifier-free guidance at some scale ``w`` gave its teacher: ``v_g = u + w (c - u)``
(``c`` conditional, ``u`` unconditional). Plain flow matching fits ``v_g`` itself to the data's
velocity, so every step pulls the model toward the *unguided* conditional velocity: the
guidance is trained away (diffusion-pipe's notes on MiniMax-H3: "any standard training
gradually undistills the model"; ai-toolkit trains the same models with a distillation term).

The objective used by diffusion-pipe for MiniMax-H3 ("CFG-augmented training", its ``cfg``
setting) reads the model's output as already guided and recovers the raw conditional velocity
with the model's own unconditional prediction, taken without gradient:
``raw = (v_g + (w - 1) u) / w``, the CFG equation solved for ``c``. ``raw`` is fitted to the
flow-matching target, so what the adapter learns is the data's conditional velocity *with the
guidance at scale w still applied on top of it*.

An entry selects the objective with its prompt part, :class:`GuidedPrompt` (a ``PromptText`` that
also hands the empty prompt's conditioning to a micro-batch when ``model.diffusion.guidance_preserving``
is set), and a ``loss`` that asks :func:`guided_loss`. ``benchmarks/guidance_preserving.py`` measures
how much closer it keeps a guidance-distilled teacher's guided output than plain flow matching.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from zeropipe.families.diffusion.parts.text import PromptText

KEY = "model.diffusion.guidance_preserving"
UNCONDITIONAL = "unconditional."  # prefix of the empty prompt's tensors in a micro-batch's condition
SCALE = "guidance_preserving_scale"  # the condition's entry holding the scale baked in (a 0-d tensor)


def guidance_preserving_loss(
    predict: Callable[[dict[str, torch.Tensor]], torch.Tensor], target: torch.Tensor, condition: dict[str, torch.Tensor],
    unconditional: dict[str, torch.Tensor], scale: float, weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Flow matching on the raw conditional velocity recovered from a guided prediction (diffusion-pipe's CFG-augmented training).

    Args:
        predict: the denoiser on the micro-batch's noisy latents, given a conditioning.
        target: the flow-matching target (noise - latents).
        scale: the guidance scale the model is read as having baked in (w > 1).
    """
    from zeropipe.families.diffusion.objectives import weighted_mse

    guided = predict(condition)
    with torch.no_grad():  # the model's own unconditional prediction is a fixed reference, as diffusion-pipe takes it
        unguided = predict(unconditional).detach()
    raw = (guided.float() + (scale - 1.0) * unguided.float()) / scale
    return weighted_mse(raw, target, weights)


def split_unconditional(condition: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None, float | None]:
    """(the conditioning, the same with the empty prompt's tensors in place of the prompt's, the scale); (condition, None, None) when off."""
    if SCALE not in condition:
        return condition, None, None
    own = {key: value for key, value in condition.items() if not key.startswith(UNCONDITIONAL) and key != SCALE}
    unconditional = {**own, **{key[len(UNCONDITIONAL):]: value for key, value in condition.items() if key.startswith(UNCONDITIONAL)}}
    return own, unconditional, float(condition[SCALE])


def guided_loss(arch: Any, model: Any, noised: Any, condition: dict[str, torch.Tensor], context: Any) -> torch.Tensor | None:
    """An entry's training loss under the guidance-preserving objective, or None when the run does not ask for it (the entry's own then).

    The denoiser is called as the entry's ``predict`` calls it, with the prompt's and with the empty prompt's conditioning.
    """
    own, unconditional, scale = split_unconditional(condition)
    if unconditional is None:
        return None

    def predict(given: dict[str, torch.Tensor]) -> torch.Tensor:
        return arch.call.loss_region(arch.call.predict(model, noised.model_input, noised.timesteps, given, context), noised.target)[0]

    target = arch.call.loss_region(noised.target, noised.target)[1]
    return guidance_preserving_loss(predict, target, own, unconditional, scale, noised.weights)


@dataclass(frozen=True)
class GuidedPrompt(PromptText):
    """The prompt part of a guidance-distilled entry: a prompt cached alone (``PromptText``), plus, when
    ``model.diffusion.guidance_preserving`` is set, the empty prompt's conditioning in every micro-batch (always cached).
    """

    def config_keys(self) -> tuple[str, ...]:
        return (KEY,)

    def problems(self, config: Any, arch: Any) -> list[tuple[str, str]]:
        scale = _scale(config)
        if scale is None:
            return []
        problems = []
        if arch.record.objective != "flow":
            problems.append((KEY, f"the guidance-preserving objective is flow matching's; {arch.record.name} trains with {arch.record.objective}: remove {KEY}"))
        if scale <= 1.0:
            problems.append((KEY, f"{scale} bakes in no guidance (the raw and the guided velocity are the same at 1): set the scale the model was distilled at, e.g. 4, or remove {KEY}"))
        return problems

    def batch(self, task: Any, captions: list[str], indices: list[int], dropped: list[bool]) -> dict[str, torch.Tensor]:
        condition = super().batch(task, captions, indices, dropped)
        scale = _scale(task.config)
        if scale is None:
            return condition
        empty = task.text_condition([""] * len(captions))
        condition.update({UNCONDITIONAL + key: value for key, value in empty.items()})
        condition[SCALE] = torch.tensor(scale)
        return condition


def _scale(config: Any) -> float | None:
    value = getattr(getattr(config.model, "diffusion", None), "guidance_preserving", None)
    return None if value is None else float(value)
