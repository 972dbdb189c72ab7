import numpy as np
import pytest

from zeropipe.errors import ZeroPipeError
from zeropipe.launch.resume import check_resume_schedule, prefer_exact_adam


def adamw(**zero) -> dict:
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2, **zero}}


def test_why_cpu_adam_cannot_resume_exactly():
    """The arithmetic the fix rests on: beta^t kept as a float32 running product is not pow(beta, t).

    DeepSpeed's CPU Adam keeps the running product in the process and a resumed process starts
    from pow(beta, t): they differ for t = 21 and 31 (the issue's resumes from steps 20 and
    30) but not for t = 11 (the resume from step 10 that happened to be exact).
    """
    beta2 = np.float32(0.999)
    product = np.float32(1.0)
    differs = {}
    for t in range(1, 32):
        product = np.float32(product * beta2)
        differs[t] = product != np.float32(np.float64(beta2) ** t)
    assert differs[21] and differs[31] and not differs[11]


def test_cpu_ranks_get_torch_adamw():
    ds_config = adamw()
    notes = prefer_exact_adam(ds_config, "cpu")
    assert ds_config["optimizer"]["params"]["torch_adam"] is True
    assert notes and "torch_adam" in notes[0]


@pytest.mark.parametrize(
    "ds_config, accelerator",
    [
        (adamw(), "cuda"),  # CUDA's FusedAdam recomputes the bias correction every step
        (adamw(offload_optimizer={"device": "cpu"}), "cpu"),  # DeepSpeedCPUAdam is much faster there
        ({"optimizer": {"type": "AdamW", "params": {"torch_adam": False}}}, "cpu"),  # the user's choice
        ({"optimizer": {"type": "Lion", "params": {}}}, "cpu"),
    ],
)
def test_other_optimizers_are_left_alone(ds_config, accelerator):
    before = repr(ds_config)
    assert prefer_exact_adam(ds_config, accelerator) == []
    assert repr(ds_config) == before


def test_same_run_length_resumes_silently():
    assert check_resume_schedule(40, 40, "step_00000020", new_schedule=False) == []
    assert check_resume_schedule(None, 60, "step_00000020", new_schedule=False) == []


def test_another_run_length_is_refused_with_both_ways_out():
    with pytest.raises(ZeroPipeError) as caught:
        check_resume_schedule(40, 60, "step_00000020", new_schedule=False)
    message = str(caught.value)
    assert "run of 40 steps" in message and "would run 60" in message
    assert "train.max_steps=40" in message and "--new-schedule" in message


def test_new_schedule_says_what_changes():
    notes = check_resume_schedule(40, 60, "step_00000020", new_schedule=True)
    assert len(notes) == 1 and "recomputed for 60 steps" in notes[0]
