"""The causal language model family: everything that is only the causal LM's.

- ``family.py``: :class:`CausalLM`, the family the registry holds (:data:`FAMILY`);
- ``prepare.py``: the launcher's data preparation (records, tokenizer, token cache, packs);
- ``task.py``: the rank task (token cache, model, loss, held-out evaluation, answers);
- ``evaluation.py``: held-out loss and perplexity, in the ranks and for ``zeropipe eval``;
- ``model.py``: building the model (ZeRO-3 partitioned, QLoRA, LoRA) and the model to export;
- ``generate.py``: ``zeropipe generate`` with a run, an export or an adapter;
- ``spec.py``: the planner's model spec.

What other families share (tokenizer, record formats, the trainer, model loading, the planner's
arithmetic) stays in the layers below (``data/``, ``engine/``, ``models/``, ``plan/``).
"""

from zeropipe.families.causal_lm.family import FAMILY, CausalLM

__all__ = ["FAMILY", "CausalLM"]
