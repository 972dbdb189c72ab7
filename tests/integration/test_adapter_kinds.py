"""DoRA, LoKr and LoHa (model.lora.kind) on a tiny causal LM, trained by 2 real DeepSpeed CPU ranks.

Each kind: the trainable count is what the planner counts (peft's own construction), the loss
falls, and the exported adapter directory loads with ``PeftModel.from_pretrained`` and gives the
merged export's logits. DoRA and LoKr train under ZeRO-3; LoHa under ZeRO-2, as check ZP021 asks
(peft sizes LoHa from the layer's weight, which ZeRO-3 has partitioned).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.integration.conftest import assert_ok, metrics, zeropipe, zeropipe_here
from tests.integration.test_lora_and_formats import base_model  # noqa: F401 - the fixture

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("kind,stage", [("dora", 3), ("lokr", 3), ("loha", 2)])
def test_an_adapter_kind_trains_on_two_ranks_and_exports_for_peft(tmp_run, base_model, kind, stage):  # noqa: F811
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from zeropipe.config.schema import LoraSection
    from zeropipe.models.adapters import adapter_parameter_sizes

    tmp_path, make = tmp_run
    lora = {"kind": kind, "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    config = make(kind, model={"config": None, "path": str(base_model), "lora": lora}, train={"max_steps": 8, "lr": 2e-2, "log_every": 2}, deepspeed={"zero_stage": stage})
    result = zeropipe("train", config)
    assert_ok(result)
    run_dir = tmp_path / "runs" / kind
    summary = json.loads((run_dir / "summary.json").read_text())
    # Two layers, each q_proj 32->32 and v_proj 32->16: what the planner counts for this kind.
    section = LoraSection(**lora)
    assert summary["parameters"]["trainable"] == 2 * (sum(adapter_parameter_sizes(section, 32, 32)) + sum(adapter_parameter_sizes(section, 32, 16)))
    rows = metrics(run_dir)
    assert rows[-1]["loss"] < rows[0]["loss"], [row["loss"] for row in rows]

    adapter = tmp_path / "adapter"
    assert_ok(zeropipe_here("export", run_dir, "--out", adapter, "--dtype", "fp32"))
    assert json.loads((adapter / "adapter_config.json").read_text())["peft_type"] == {"dora": "LORA", "lokr": "LOKR", "loha": "LOHA"}[kind]
    marker = {"dora": "lora_magnitude_vector", "lokr": "lokr_w", "loha": "hada_w"}[kind]
    assert any(marker in key for key in load_file(adapter / "adapter_model.safetensors"))
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32), adapter).eval()
    merged_dir = tmp_path / "merged"
    assert_ok(zeropipe_here("export", run_dir, "--out", merged_dir, "--merge", "--dtype", "fp32"))
    ids = torch.tensor([[1, 5, 9, 14, 20, 33]])
    with torch.no_grad():
        untouched = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32).eval()(ids).logits
        via_peft = peft_model(ids).logits
        via_merge = AutoModelForCausalLM.from_pretrained(merged_dir).eval()(ids).logits
    assert torch.allclose(via_peft, via_merge, atol=1e-4)
    assert not torch.allclose(via_peft, untouched, atol=1e-4), f"the {kind} adapter changed nothing"
