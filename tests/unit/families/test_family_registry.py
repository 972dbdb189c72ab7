"""The family registry: built-ins in detection order, family_of / family_of_dir, register, and plug-ins."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import zeropipe.families as registry
from zeropipe.config.schema import ModelSection
from zeropipe.errors import ConfigError, ZeroPipeError


class FakeFamily:
    """Just what the registry reads of a family: its name and its two detectors."""

    def __init__(self, name: str, claims: bool = True):
        self.name, self.claims = name, claims

    def detect(self, section) -> bool:
        return self.claims

    def detect_dir(self, path) -> bool:
        return self.claims


@pytest.fixture(autouse=True)
def own_registry(monkeypatch):
    """Each test sees the built-ins alone and leaves the process's registry as it found it."""
    monkeypatch.delenv("ZEROPIPE_PLUGINS", raising=False)
    registry.families()  # loaded before the snapshot, so that the snapshot holds the built-ins
    saved = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


def llama() -> dict:
    return {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}


def test_the_builtins_are_detected_diffusion_then_vlm_then_causal_lm():
    assert list(registry.families()) == list(registry.BUILTIN) == ["diffusion", "vlm", "causal_lm"]
    assert all(registry.family_named(name).name == name for name in registry.BUILTIN)


def test_family_of_reads_model_config_and_model_path(tmp_path):
    assert registry.family_of(ModelSection(config={"pipeline": "tiny-sdxl"})).name == "diffusion"
    assert registry.family_of(ModelSection(config=llama())).name == "causal_lm"

    pipeline = tmp_path / "pipeline"
    pipeline.mkdir()
    (pipeline / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    assert registry.family_of(ModelSection(path=str(pipeline))).name == "diffusion"

    vlm = tmp_path / "vlm"
    vlm.mkdir()
    (vlm / "config.json").write_text(json.dumps({"model_type": "llava", "vision_config": {}, "text_config": llama()}))
    assert registry.family_of(ModelSection(path=str(vlm))).name == "vlm"

    llm = tmp_path / "llm"
    llm.mkdir()
    (llm / "config.json").write_text(json.dumps(llama()))
    assert registry.family_of(ModelSection(path=str(llm))).name == "causal_lm"


def test_a_family_the_user_names_wins_over_detection():
    assert registry.family_of(ModelSection(family="causal_lm", config={"pipeline": "tiny-sdxl"})).name == "causal_lm"


def test_an_unknown_family_name_is_a_config_error_that_lists_the_known_ones():
    with pytest.raises(ConfigError) as caught:
        registry.family_of(ModelSection(family="audio", config=llama()))
    [(key, message)] = caught.value.problems
    assert key == "model.family" and "'audio'" in message
    assert all(name in message for name in ("auto", "diffusion", "vlm", "causal_lm"))


def test_family_of_dir_tells_pipelines_vlms_and_llms_apart_and_names_an_unknown_directory(tmp_path):
    for name, files in {
        "pipeline": {"model_index.json": {}},
        "vlm": {"config.json": {"vision_config": {}}},
        "llm": {"config.json": llama()},
    }.items():
        (tmp_path / name).mkdir()
        for filename, content in files.items():
            (tmp_path / name / filename).write_text(json.dumps(content))
    assert [registry.family_of_dir(tmp_path / name).name for name in ("pipeline", "vlm", "llm")] == ["diffusion", "vlm", "causal_lm"]

    (tmp_path / "empty").mkdir()
    with pytest.raises(ZeroPipeError, match="empty holds no model ZeRO-Pipe knows"):
        registry.family_of_dir(tmp_path / "empty")


def test_a_family_registered_first_is_detected_before_the_builtins():
    toy = registry.register(FakeFamily("toy"), first=True)
    assert list(registry.families()) == ["toy", "diffusion", "vlm", "causal_lm"]
    assert registry.family_of(ModelSection(config={"pipeline": "tiny-sdxl"})) is toy
    assert registry.family_of_dir(Path("/nowhere")) is toy

    # Registering it again moves it, it does not duplicate it.
    registry.register(FakeFamily("toy", claims=False), first=True)
    assert list(registry.families()) == ["toy", "diffusion", "vlm", "causal_lm"]
    assert registry.family_of(ModelSection(config={"pipeline": "tiny-sdxl"})).name == "diffusion"


def test_a_family_registered_last_is_reached_by_name_only_and_unregister_removes_it():
    toy = registry.register(FakeFamily("toy"))
    assert list(registry.families()) == ["diffusion", "vlm", "causal_lm", "toy"]
    assert registry.family_of(ModelSection(config=llama())).name == "causal_lm"  # causal_lm takes whatever is left
    assert registry.family_of(ModelSection(family="toy", config=llama())) is toy

    registry.unregister("toy")
    registry.unregister("toy")  # a second time is harmless
    assert "toy" not in registry.families()
    with pytest.raises(ConfigError, match="unknown model family 'toy'"):
        registry.family_named("toy")


def test_with_no_family_claiming_a_model_the_error_says_to_set_model_family():
    registry._REGISTRY.clear()
    registry.register(FakeFamily("picky", claims=False))
    with pytest.raises(ConfigError, match="set model.family"):
        registry.family_of(ModelSection(config=llama()))


def test_plugins_named_in_zeropipe_plugins_register_on_first_use(tmp_path, monkeypatch):
    (tmp_path / "first_plugin.py").write_text(
        "from zeropipe.families import register\n"
        "class Family:\n"
        "    name = 'first_plugin'\n"
        "    def detect(self, section): return True\n"
        "    def detect_dir(self, path): return True\n"
        "register(Family(), first=True)\n"
    )
    (tmp_path / "last_plugin.py").write_text(
        "from zeropipe.families import register\n"
        "class Family:\n"
        "    name = 'last_plugin'\n"
        "    def detect(self, section): return False\n"
        "    def detect_dir(self, path): return False\n"
        "register(Family())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("ZEROPIPE_PLUGINS", " first_plugin, ,last_plugin ")
    for module in ("first_plugin", "last_plugin"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    # A fresh process: nothing loaded yet, so the first question loads the built-ins, then the plug-ins.
    registry._REGISTRY.clear()
    monkeypatch.setattr(registry, "_loaded", False)

    assert list(registry.families()) == ["first_plugin", "diffusion", "vlm", "causal_lm", "last_plugin"]
    assert registry.family_of(ModelSection(config={"pipeline": "tiny-sdxl"})).name == "first_plugin"
    assert registry.family_named("last_plugin").name == "last_plugin"


def test_a_plugin_that_cannot_be_imported_is_named_with_its_error(tmp_path, monkeypatch):
    (tmp_path / "broken_plugin.py").write_text("raise RuntimeError('needs a GPU library')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "broken_plugin", raising=False)
    monkeypatch.setenv("ZEROPIPE_PLUGINS", "broken_plugin")
    with pytest.raises(ConfigError) as caught:
        registry.load_plugins()
    [(key, message)] = caught.value.problems
    assert key == "ZEROPIPE_PLUGINS"
    assert "'broken_plugin'" in message and "RuntimeError: needs a GPU library" in message and "fix it or remove it" in message

    monkeypatch.setenv("ZEROPIPE_PLUGINS", "no_such_module_anywhere")
    with pytest.raises(ConfigError, match="'no_such_module_anywhere' cannot be imported \\(ModuleNotFoundError"):
        registry.load_plugins()


def test_a_second_thread_waits_for_the_built_ins_instead_of_finding_none(monkeypatch):
    """The web UI asked from two threads at once: the second found a half-filled registry ("no model family recognises this model")."""
    import importlib
    import threading
    import time
    import types

    def slow_import(name):
        time.sleep(0.2)  # the first import of a family module takes a while (torch, transformers)
        return importlib.import_module(name)

    registry._REGISTRY.clear()
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(registry, "importlib", types.SimpleNamespace(import_module=slow_import))
    first = threading.Thread(target=registry.families)
    first.start()
    time.sleep(0.05)  # the first thread is loading now
    assert registry.family_of(ModelSection(config=llama())).name == "causal_lm"
    first.join()


@pytest.mark.parametrize("model", [{"config": {"model_type": "llava", "vision_config": {}, "text_config": llama()}}])
def test_quantization_outside_causal_lms_is_refused_by_check(tmp_path, model):
    """QLoRA's 4-bit base on a VLM run (it would fail in the ranks): ZP000 names the key before anything starts.

    Diffusion runs take an nf4/int8 base under ZeRO-0..2 (tests/unit/diffusion/test_bnb_base.py)."""
    from zeropipe.check.run import check_config
    from zeropipe.config.load import validate_config
    from zeropipe.plan.hardware import GIB, Hardware

    images = tmp_path / "images"
    images.mkdir()
    config = validate_config(
        {"model": {**model, "lora": {"r": 4}, "quantization": {}}, "data": {"path": str(images)}, "deepspeed": {"zero_stage": 2, "precision": "fp32"}, "hardware": {"gpus": 2}}
    )
    hardware = Hardware(gpus_per_node=2, gpu_memory_bytes=24 * GIB, nodes=1, host_ram_bytes=64 * GIB, accelerator="cuda", gpu_bf16_native=True)
    findings = [f for f in check_config(config, accelerator="cuda", hardware=hardware) if f.key == "model.quantization"]
    family = registry.family_of(config.model).name
    assert any(f.rule == "ZP000" and f.severity == "error" and f"this is a {family} run" in f.message for f in findings), findings
