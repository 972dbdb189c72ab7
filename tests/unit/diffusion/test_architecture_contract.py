"""The declared wiring every registered diffusion architecture keeps, one parametrized test per entry, without DeepSpeed.

Each registered entry (``zeropipe.families.diffusion.entries``: the built-ins and any plug-in registered
before collection) goes through the run's own code in this process, on its tiny preset:

- its tiny preset builds (the launcher's data step, ``prepare_run``: the tiny pipeline saved, buckets, cache
  keys) and every setting its parts read (``config_keys``) is one the data section provides;
- the node's cache filling (``fill_caches``) and the cache round trip: a second data step finds every latent
  and text entry (nothing to encode), and entries written again into another cache folder read back identical;
- the rank's task (``DiffusionTask`` of a real ``Trainer`` on the prepared run, its data set up as a rank does)
  assembles a micro-batch from the caches; the entry's LoRA targets wrap linear layers only, and some;
  ``predict`` on the tiny denoiser (diffusers' ``from_pretrained``, plain torch) gives the objective's target
  shape, the entry's loss is finite and its gradient reaches most LoRA up-projections (B starts at zero);
- the entry's sampling (``RankTask.generate_samples``) draws one sample with that denoiser;
- the LoRA in the entry's original (ComfyUI) layout, where it has one, maps every adapter key without error.

Where each assertion of the former per-entry ZeRO-3 run is made now:

- data step, caches, cache round trip, sample written, LoRA up-projections get gradients through predict:
  here, for every entry (gradients instead of two trained steps: B moves from zero iff its gradient is non-zero);
- trained under ZeRO-3 (``zero_optimization_stage() == 3``), two steps reached with finite step and fixed-batch
  losses, the LoRA export read by diffusers' loader changes the denoiser, the merged export gives base + LoRA:
  tests/integration/test_architecture_kinds.py, for one entry of each kind of part (``one_entry_per_kind``:
  image and video codecs, DDPM and flow objectives, each prompt part and each condition class);
- DoRA, LoKr (with its ComfyUI layout) and LoHa under ZeRO-3/2, their exports and resume: the same
  integration module (moved unchanged).

The entry's shape (fast, no tiny preset built): ``Architecture`` has at most 15 members, and every registered
entry is a declared ``Record`` plus one role of each kind, its classes found in diffusers, its record's constants
well formed (``test_the_entry_core_has_at_most_15_members``, ``test_every_entry_is_a_record_and_its_roles``).

Every assertion names the entry.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.diffusion_contract import cached_run, one_entry_per_kind
from zeropipe.families.diffusion import entries as architectures
from zeropipe.families.diffusion import roles
from zeropipe.families.diffusion.core import ROLES, Architecture, Record

ENTRIES = sorted(architectures.architectures())


MOST_MEMBERS = 15


def core_members(cls) -> list[str]:
    """The members a class defines itself: its fields, properties and methods (dunder methods such as ``__post_init__`` aside)."""
    import dataclasses

    fields = [field.name for field in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []
    own = [name for name, value in vars(cls).items() if not name.startswith("__") and (callable(value) or isinstance(value, (property, staticmethod, classmethod)))]
    return sorted(set(fields) | set(own))


def test_the_entry_core_has_at_most_15_members():
    members = core_members(Architecture)
    assert len(members) <= MOST_MEMBERS, f"Architecture has {len(members)} members ({', '.join(members)}): a constant belongs in the Record, code in a role"
    # The counter counts fields, properties and methods (the retired old-shape class had 46).
    import dataclasses

    wide = dataclasses.make_dataclass("Wide", [(f"field_{n}", int) for n in range(MOST_MEMBERS)], namespace={"method": lambda self: 0, "prop": property(lambda self: 0)})
    assert len(core_members(wide)) == MOST_MEMBERS + 2


def test_a_plugin_entry_that_is_not_an_architecture_is_refused_with_the_way_to_write_one():
    from zeropipe.errors import ConfigError
    from zeropipe.families.diffusion.entries import register

    class OldShape:  # one class with constant methods: the retired shape
        name = "old"

        def tokenizer_length(self):
            return 77

    with pytest.raises(ConfigError, match=r"OldShape is not a diffusion entry: register Architecture\(record=Record"):
        register(OldShape())


ROLE_CLASSES = {"call": roles.DenoiserCall, "prompts": roles.PromptEncoding, "sampling": roles.Sampling, "layouts": roles.ExportLayouts, "assembly": roles.Assembly}


@pytest.mark.parametrize("name", ENTRIES)
def test_every_entry_is_a_record_and_its_roles(name):
    """The declared wiring without building anything: a record, a role of each kind bound to this entry, classes diffusers has."""
    import diffusers

    arch = architectures.architecture_named(name)
    record = arch.record
    assert isinstance(arch, Architecture) and isinstance(record, Record) and record.name == name, f"{name}: not a declared record"
    assert set(ROLES) == set(ROLE_CLASSES)
    hash(arch)  # an entry is a frozen value, usable as a key, as the former class was
    for role, cls in ROLE_CLASSES.items():
        bound = getattr(arch, role)
        assert isinstance(bound, cls) and bound.entry is arch and bound.record is record, f"{name}: its {role} role is not a {cls.__name__} bound to it"
    for class_name in (record.pipeline_class, record.denoiser_class, *record.related_pipelines):
        assert hasattr(diffusers, class_name), f"{name}: diffusers has no {class_name}"
    assert record.objective in ("ddpm", "flow") and record.denoiser in ("unet", "transformer"), f"{name}: {record.objective} / {record.denoiser}"
    assert record.preset_name and record.denoiser in record.preset, f"{name}: its tiny preset has no {record.denoiser}"
    assert all(record.tokenizer_length(tokenizer) > 0 for tokenizer in record.tokenizers) and record.trace_text_tokens() > 0, f"{name}: prompt lengths"
    assert record.image_processor_patch >= 1 and record.patch_factor >= 1 and record.trace_frames >= 1
    assert set(record.frozen_components) <= {"vae", *record.preset}, f"{name}: frozen components {record.frozen_components} not in its preset"
    assert not (set(record.pipeline_kwargs) & set(record.preset)), f"{name}: pipeline_kwargs name components"


@pytest.fixture(autouse=True)
def cpu_deepspeed(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


def rank_task(run, monkeypatch):
    """The rank's task of a prepared run, set up as a rank sets up its data; the denoiser is built here, without DeepSpeed."""
    from zeropipe.engine.trainer import Trainer
    from zeropipe.families import family_of

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    trainer = Trainer(run.path, family_of(run.read_config().model).rank_task)
    trainer.device = torch.device("cpu")  # what Trainer.setup decides on a CPU run, before the task's data
    trainer.task.setup_data()
    return trainer


def lora_denoiser(task):
    """The run's denoiser with the run's LoRA, as the task builds it, in plain torch (fp32, no ZeRO partitioning)."""
    from zeropipe.models.adapters import peft_adapter_config
    from zeropipe.models.common import resolve_lora_targets

    cls = task.arch.model_class()
    model = cls.from_pretrained(str(task.pipeline_dir / task.data.denoiser), torch_dtype=torch.float32)
    model.requires_grad_(False)
    lora = task.config.model.lora
    model.add_adapter(peft_adapter_config(lora, resolve_lora_targets(lora, task.arch.record.lora_targets), gaussian_init=True))
    return model


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ENTRIES)
def test_an_entry_declares_wiring_that_caches_predicts_samples_and_lays_out_its_lora(tmp_path, monkeypatch, name):
    from peft.tuners.lora import LoraLayer
    from peft.utils import get_peft_model_state_dict

    arch = architectures.architecture_named(name)
    assert arch.record.preset_name, f"{name}: every entry has a tiny preset (its tests and demos build it from config)"
    run = cached_run(name, arch, tmp_path)

    trainer = rank_task(run, monkeypatch)
    task = trainer.task
    model = lora_denoiser(task)
    wrapped = {module_name: module for module_name, module in model.named_modules() if isinstance(module, LoraLayer)}
    assert wrapped, f"{name}: its LoRA targets {arch.record.lora_targets} match no layer of {arch.record.denoiser_class}"
    not_linear = sorted(module_name for module_name, module in wrapped.items() if not isinstance(module.get_base_layer(), torch.nn.Linear))
    assert not not_linear, f"{name}: LoRA targets that are not linear layers: {not_linear[:4]}"

    task.after_initialize()
    torch.manual_seed(0)
    latents, condition = task.assemble([0], augment=False)
    noised = task.objective.noise(latents, generator=torch.Generator().manual_seed(1))
    model.train()
    prediction = arch.call.predict(model, noised.model_input, noised.timesteps, condition, task.predict_context)
    assert prediction.shape == noised.target.shape, f"{name}: predict gave {tuple(prediction.shape)}, the objective's target is {tuple(noised.target.shape)}"
    loss = arch.call.loss(model, noised, condition, task.predict_context)
    assert torch.isfinite(loss), f"{name}: loss {loss}"
    loss.backward()
    ups = {param_name: param for param_name, param in model.named_parameters() if "lora_B" in param_name}
    moved = [param_name for param_name, param in ups.items() if param.grad is not None and param.grad.abs().max() > 0]
    # A few may get none because the model discards their output (Qwen-Image's last block's text stream), never most.
    assert ups and len(moved) > len(ups) / 2, f"{name}: {len(ups) - len(moved)} of {len(ups)} LoRA up-projections get no gradient through predict: {sorted(set(ups) - set(moved))[:4]}"

    # The entry's sampling, with this denoiser where a rank holds its DeepSpeed engine's module.
    model.zero_grad(set_to_none=True)
    trainer.engine = SimpleNamespace(module=model)
    task.generate_samples()
    samples = sorted(p.name for p in (run.path / "samples").rglob("*") if p.is_file() and p.name != "index.jsonl")
    assert samples, f"{name}: no sample written"

    # The LoRA as trained (A and B random, every module counting), in the entry's original layout.
    generator = torch.Generator().manual_seed(11)
    adapter = [param for param_name, param in model.named_parameters() if "lora_" in param_name]
    with torch.no_grad():
        for param in adapter:
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    trained = [param.detach().clone() for param in adapter]
    layers = {key: value.detach().clone() for key, value in get_peft_model_state_dict(model).items()}
    original = arch.layouts.original_lora_layout(layers, float(task.config.model.lora.alpha))  # raises ValueError on a key it cannot place
    assert original is None or (original and all(torch.isfinite(value).all() for value in original.values())), f"{name}: original LoRA layout {sorted(original or {})[:4]}"
    if original:
        # model.lora.init_from reads the file back (models.adapter_init): the same weights on the same modules, or, where
        # the layout fuses layers, a refusal naming the fused keys.
        from safetensors.torch import save_file

        from zeropipe.errors import ConfigError
        from zeropipe.models.adapter_init import load_initial_adapter

        save_file({key: value.contiguous() for key, value in original.items()}, str(tmp_path / "original.safetensors"))
        with torch.no_grad():
            for param in adapter:
                param.zero_()
        try:
            load_initial_adapter(model, tmp_path / "original.safetensors", original_layout=arch.layouts.original_lora_layout)
        except ConfigError as err:
            assert "fuses" in str(err), f"{name}: its own original LoRA layout is not read back: {err}"
        else:
            for param, expected in zip(adapter, trained):
                torch.testing.assert_close(param.detach(), expected, rtol=1e-5, atol=1e-6, msg=f"{name}: read back from its original layout")


def test_the_integration_lane_runs_one_entry_of_each_kind_of_part():
    """The full ZeRO-3 runs cover every kind of part a registered entry has; a new kind adds an entry there."""
    from tests.diffusion_contract import part_kinds

    chosen = one_entry_per_kind(ENTRIES)
    every = set().union(*(part_kinds(architectures.architecture_named(name)) for name in ENTRIES))
    covered = set().union(*(part_kinds(architectures.architecture_named(name)) for name in chosen))
    assert covered == every and len(chosen) < len(ENTRIES) / 2, (chosen, every - covered)
