"""The planner's activation terms under sequence parallelism: each rank holds 1/N of a sample's tokens (issue 40)."""

from dataclasses import replace

from zeropipe.plan.activations import activation_terms, saved_activation_bytes
from zeropipe.plan.memory import Choice


def test_activation_terms_fall_to_one_over_n(spec_of):
    spec = spec_of("llama-3.2-1b")
    for checkpointing in (False, True):
        one = Choice(precision="fp32", seq_len=4096, micro_batch_size=1, gradient_checkpointing=checkpointing)
        two = replace(one, sequence_parallel=2)
        assert [t.bytes for t in activation_terms(spec, two)] == [t.bytes // 2 for t in activation_terms(spec, one)]
        assert saved_activation_bytes(spec, two) == saved_activation_bytes(spec, one) // 2
        assert "s=4096/2 (sequence parallel)" in activation_terms(spec, two)[0].explanation
    assert "sequence parallel 2" in two.describe()
