"""The diffusion family: everything that is only the diffusion family's.

- ``family.py``: :class:`Diffusion`, the family the registry holds (:data:`FAMILY`);
- ``prepare.py``: the launcher's data preparation (items, buckets, cache keys) and the node's
  setup step that fills the latent and text caches (``fill_caches``);
- ``task.py``: the rank task (cached or encoded batches, the objective, samples);
- ``export.py``: diffusers pipelines, peft and original-layout (ComfyUI) LoRAs;
- ``spec.py``: the planner's model spec.

The architectures and their parts (``zeropipe.diffusion.architectures``, ``zeropipe.diffusion.parts``),
images, clips, caches, objectives and pipeline loading stay in ``zeropipe.diffusion``, below the
families: the planner traces through the architecture entries too.
"""

from zeropipe.families.diffusion.family import FAMILY, Diffusion

__all__ = ["FAMILY", "Diffusion"]
