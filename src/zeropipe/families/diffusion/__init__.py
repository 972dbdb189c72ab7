"""The diffusion family: everything that is only the diffusion family's.

- ``family.py``: :class:`Diffusion`, the family the registry holds (:data:`FAMILY`);
- ``prepare.py``: the launcher's data preparation (items, buckets, cache keys) and the node's
  setup step that fills the latent and text caches (``fill_caches``);
- ``task.py``: the rank task (cached or encoded batches, the objective, samples);
- ``export.py``: diffusers pipelines, peft and original-layout (ComfyUI) LoRAs;
- ``spec.py``: the planner's model spec of a run; ``plan_specs.py``: the builders it registers with the
  planner (catalog entries, diffusers model configs, pipeline folders, the denoiser's activation trace);
- ``entries/``: the architecture entries (one module each, a registry in ``entries/__init__.py``), no
  entry importing another; ``core.py``: the entry core (``Architecture``: a declared ``Record`` and its roles),
  ``roles.py``: the roles (denoiser call, prompt encoding, sampling, export layouts, assembly), ``sampler.py``:
  the one sampler (training's samples and the UI's Draw); ``bases/``: what entries of
  one model line share; ``parts/``: the parts entries are built from (latent codecs, prompt text,
  conditions); ``tiny/``: the tiny presets' tokenizers and components;
- ``pipelines.py`` (loading diffusers pipelines and components, tiny presets), ``cache.py`` (the
  latent and text caches), ``objectives.py`` (DDPM and flow matching), ``buckets.py`` (aspect-ratio
  buckets and micro-batches per rank).

Reading images, clips and sound is shared with the other families and the web UI: ``data/images.py``,
``data/videos.py``, ``data/audio.py``.
"""

from zeropipe.families.diffusion.family import FAMILY, Diffusion

__all__ = ["FAMILY", "Diffusion"]
