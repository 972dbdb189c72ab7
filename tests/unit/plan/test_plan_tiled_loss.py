"""The planner's loss term with the sequence-tiled loss (parallel.tiled_loss, issue 40): one tile of logits, not the sequence's."""

from dataclasses import replace

from zeropipe.plan.activations import AUTO_TILED_LOSS_BYTES, activation_terms, loss_tile_tokens, saved_activation_bytes
from zeropipe.plan.memory import Choice


def loss_term(spec, choice):
    return next(t for t in activation_terms(spec, choice) if t.name == "logits and loss")


def test_the_loss_term_counts_one_tile_when_tiled(spec_of):
    spec = spec_of("llama-3.2-1b")  # vocabulary 128,256, hidden 2048
    vocab, hidden = spec.vocab_size, spec.block.hidden
    tiled = Choice(precision="bf16", seq_len=131_072, micro_batch_size=1, gradient_checkpointing=True, tiled_loss=True, loss_tile_tokens=4096)
    untiled = replace(tiled, tiled_loss=False)
    # Untiled: 4·s·V saved plus the 16-bit logits and their fp32 copy (64 GiB at 128k tokens).
    assert loss_term(spec, untiled).bytes >= 131_072 * vocab * (4 + 2 + 4)
    # Tiled: the tile's 16-bit logits, fp32 copy, log-softmax and its gradient, the kept hidden states, their gradient and the norm.
    term = loss_term(spec, tiled)
    assert "one tile of 4,096 tokens" in term.explanation
    assert term.bytes == 4096 * vocab * (2 + 4 + 4 + 4) + 131_072 * hidden * (2 + 2 + 4 + 2)
    assert term.bytes < loss_term(spec, untiled).bytes / 15
    # Each tile token costs V values of each kind; the saved bytes lose the whole 4·s·V log-softmax.
    assert loss_term(spec, replace(tiled, loss_tile_tokens=8192)).bytes - term.bytes == 4096 * vocab * 14
    assert saved_activation_bytes(spec, untiled) - saved_activation_bytes(spec, tiled) == 131_072 * vocab * 4
    # Sequence parallelism divides the hidden states; the tile stays.
    split = loss_term(spec, replace(tiled, sequence_parallel=4))
    assert split.bytes == 4096 * vocab * 14 + 32_768 * hidden * 10


def test_auto_tiles_above_one_gib_of_fp32_logits(spec_of):
    vocab = spec_of("llama-3.2-1b").vocab_size
    limit = AUTO_TILED_LOSS_BYTES // (4 * vocab)
    assert loss_tile_tokens("auto", limit, vocab, 4096) == 0
    assert loss_tile_tokens("auto", limit + 1, vocab, 4096) == limit + 1  # never a tile longer than the micro-batch
    assert loss_tile_tokens("auto", 100_000, vocab, 4096) == 4096
    assert loss_tile_tokens(True, 1000, vocab, 4096) == 1000
    assert loss_tile_tokens(False, 10**6, vocab, 4096) == 0
