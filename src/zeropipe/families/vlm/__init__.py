"""The vision-language family: everything that is only the VLM's.

- ``family.py``: :class:`VisionLanguage`, the family the registry holds (:data:`FAMILY`);
- ``prepare.py``: the launcher's part (the data read and checked, the processor built or copied);
- ``data.py``: image-text formats, the manifest, encoding examples with the processor, batches;
- ``task.py``: the rank task (dataset, model with its frozen parts, loss, answers with images);
- ``model.py``: the processor and the model (parts that train, LoRA on them, the model to export);
- ``generate.py``: ``zeropipe generate`` with an image per prompt;
- ``spec.py``: the planner's model spec.

It shares with the causal LM only what lies in the layers below (the chat template and
tokenizer of ``data/``, ``models.common``, ``engine.task.write_generations``, the planner's
counters), never the causal LM's own package.
"""

from zeropipe.families.vlm.family import FAMILY, VisionLanguage

__all__ = ["FAMILY", "VisionLanguage"]
