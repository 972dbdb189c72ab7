"""The sequence-tiled LM loss (``parallel.tiled_loss``): the LM head and cross-entropy tile by tile, recomputed in backward.

The untiled loss materialises the logits of every local token: s x V values in 16 bits, an fp32
copy and the fp32 log-softmax saved for backward (4·s·V bytes); at 100k tokens and a 128k
vocabulary that is 51 GiB, more than the whole model. Tiled, the model returns its final hidden
states (the LM head sees none of them: a forward pre-hook hands it zero tokens), and
:class:`TiledLMLoss` runs the head and the cross-entropy on ``tile`` tokens at a time, keeping
nothing but the hidden states it was given; backward recomputes each tile's logits and adds up
the gradients. The peak is then one tile's logits (tile x V), whatever the sequence length.

Why not DeepSpeed's ``TiledFusedLogitsLoss`` (``runtime/sequence_parallel/ulysses_sp.py``): it runs
each tile's backward inside forward with an incoming gradient of 1 (or 1/shards) and returns the
stored input gradient later, scaled by the gradient that arrives. The head *weight*'s gradient is
accumulated in forward and never sees that gradient, so every factor applied to the loss after it
is lost for the weight: ZeRO-Pipe's division by the labelled tokens of the (sequence-parallel
group's) micro-batch, the engine's 1/gradient_accumulation_steps, fp16's loss scale and the
factor N ZeRO-3 needs under sequence parallelism. Recomputing in backward gets the real incoming
gradient for both. The DeepSpeed ZeRO hook contract is the one ``TiledFusedLogitsLoss`` uses:
``param.ds_grad_is_ready`` is False until the last tile, so ZeRO reduces each head parameter once.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from zeropipe.plan.activations import AUTO_TILED_LOSS_BYTES, loss_tile_tokens

log = logging.getLogger("zeropipe")

# Model configs whose forward changes the logits after the LM head (final soft-capping, a logit scale):
# the tiled loss calls the head alone, so these keep the model's own loss.
LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the tiled loss cannot replace this model's loss, or None when it can."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return "the model has no output embeddings (LM head) to tile"
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    for name in LOGIT_POSTPROCESSING:
        value = getattr(text, name, None)
        if value not in (None, 1, 1.0, 0, 0.0):
            return f"its forward post-processes the logits ({name}={value}), which the tiled loss would skip"
    if getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or getattr(text, "n_routed_experts", None):
        return "a mixture of experts adds its router's auxiliary loss to the model's loss"
    return None


def choose(setting: bool | str, tile: int, local_tokens: int, vocab: int, model: torch.nn.Module) -> tuple[int, str]:
    """(tile size or 0 for the untiled loss, the sentence the run log says) for ``parallel.tiled_loss``.

    Raises:
        ValueError: ``tiled_loss: true`` on a model it cannot tile (the message names the key and the reason).
    """
    reason = unsupported_reason(model)
    logits = local_tokens * vocab * 4
    if reason is not None:
        if setting is True:
            raise ValueError(f"parallel.tiled_loss: true cannot be used with this model: {reason}. Set parallel.tiled_loss: false (or auto).")
        return 0, f"tiled loss: off ({reason})"
    chosen = loss_tile_tokens(setting, local_tokens, vocab, tile)
    amount = f"{logits / 2**30:.2f} GiB" if logits >= 2**27 else f"{logits / 2**20:.1f} MiB"
    size = f"{local_tokens:,} local tokens x {vocab:,} vocabulary = {amount} of fp32 logits per micro-batch"
    if chosen:
        why = "parallel.tiled_loss: true" if setting is True else f"parallel.tiled_loss: auto, above {AUTO_TILED_LOSS_BYTES / 2**30:.0f} GiB"
        return chosen, f"tiled loss: on, {chosen:,} tokens per tile ({size}; {why})"
    why = "parallel.tiled_loss: false" if setting is False else f"parallel.tiled_loss: auto, at most {AUTO_TILED_LOSS_BYTES / 2**30:.0f} GiB"
    return 0, f"tiled loss: off ({size}; {why})"


class _HiddenStates:
    """A forward pre-hook on the LM head: keeps the hidden states it is handed and gives it zero tokens instead."""

    def __init__(self, head: torch.nn.Module):
        self.hidden: torch.Tensor | None = None
        self.handle = head.register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.hidden = args[0]
        return (args[0][..., :0, :],) + tuple(args[1:])


def model_hidden_states(model: Any, head: torch.nn.Module, **inputs) -> torch.Tensor:
    """The final hidden states (after the final norm) of ``model(**inputs)``, without computing the logits."""
    hook = _HiddenStates(head)
    try:
        model(**inputs, use_cache=False)
    finally:
        hook.handle.remove()
    assert hook.hidden is not None, "the model's forward did not call its LM head"
    return hook.hidden


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM shift: token t is labelled with token t+1's label (-100 after the last)."""
    return torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]


def _tile_sum(head: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # As transformers' ForCausalLMLoss: the logits upcast to fp32, the sum over labelled tokens.
    logits = head(x).float()
    return torch.nn.functional.cross_entropy(logits, y, ignore_index=-100, reduction="sum")


def _tile_count(tokens: int, tile: int, zero3: bool, device: torch.device) -> int:
    """Tiles of this rank; under ZeRO-3 the most of any rank (each head call gathers its weight over all ranks, a collective)."""
    count = max(1, -(-tokens // tile))
    if zero3:
        import deepspeed.comm as dist

        figure = torch.tensor([count], dtype=torch.long, device=device)
        dist.all_reduce(figure, op=dist.ReduceOp.MAX)
        count = int(figure.item())
    return count


class TiledLMLoss(torch.autograd.Function):
    """Sum of the token cross-entropies of ``head(hidden)`` against ``labels`` (already shifted), ``tile`` tokens at a time.

    ``zero3``: every rank must call the head equally often (each call gathers its weight): the ranks
    agree on the tile count first, and zero-token tiles pad the shorter ranks.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, labels: torch.Tensor, head: torch.nn.Module, tile: int, zero3: bool = False) -> torch.Tensor:
        x, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        count = _tile_count(x.shape[0], tile, zero3, hidden.device)
        ctx.head, ctx.tile, ctx.count = head, tile, count
        ctx.save_for_backward(hidden, labels)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for index in range(count):
            total += _tile_sum(head, x[index * tile : (index + 1) * tile], y[index * tile : (index + 1) * tile])
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, labels = ctx.saved_tensors
        head, tile, count = ctx.head, ctx.tile, ctx.count
        x, y = hidden.reshape(-1, hidden.shape[-1]).detach(), labels.reshape(-1)
        x_grad = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
        params = [p for p in head.parameters() if p.requires_grad]
        # A head tied to the input embeddings gets its embedding gradient later in this backward: ZeRO must
        # reduce the parameter then, once, with both parts in .grad.
        tied = _tied_to_input_embeddings(head)
        try:
            for index in range(count):
                for param in params:
                    param.ds_grad_is_ready = index == count - 1 and not tied
                part = x[index * tile : (index + 1) * tile].requires_grad_(x_grad is not None)
                with torch.enable_grad():
                    loss = _tile_sum(head, part, y[index * tile : (index + 1) * tile])
                if loss.requires_grad:
                    torch.autograd.backward(loss, grad)
                if x_grad is not None and part.grad is not None:
                    x_grad[index * tile : index * tile + part.shape[0]] = part.grad
        finally:
            for param in params:
                param.ds_grad_is_ready = True
        return (x_grad.view_as(hidden) if x_grad is not None else None), None, None, None, None


def _tied_to_input_embeddings(head: torch.nn.Module) -> bool:
    return bool(getattr(head, "_zeropipe_tied", False))


def mark_tied(model: torch.nn.Module) -> None:
    """Remember on the LM head whether its weight is the input embeddings' (the tiled backward's ZeRO hand-off needs it)."""
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    head._zeropipe_tied = embeddings is not None and getattr(head, "weight", None) is getattr(embeddings, "weight", 0)


def token_loss_sum(model: Any, head: torch.nn.Module, tile: int, zero3: bool = False, *, labels: torch.Tensor, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the token losses, labelled-token count) of one micro-batch, tiled; ``labels`` unshifted as the model takes them."""
    hidden = model_hidden_states(model, head, **inputs)
    targets = shift_labels(labels.to(hidden.device))
    return TiledLMLoss.apply(hidden, targets, head, tile, zero3), (targets != -100).sum()


def tiled_sum_of_shifted(model: Any, head: torch.nn.Module, tile: int, zero3: bool = False, *, shift_labels: torch.Tensor, **inputs) -> torch.Tensor:
    """The sum of the token losses against labels already shifted (sequence parallelism shifts before it splits)."""
    hidden = model_hidden_states(model, head, **inputs)
    return TiledLMLoss.apply(hidden, shift_labels.to(hidden.device), head, tile, zero3)
