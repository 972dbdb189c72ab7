"""Node-setup functions the supervisor tests run in a real ``zeropipe.launch.node_setup`` process."""

import os
import signal

from zeropipe.errors import DataError


def unreadable_vae(run, device, encoder_dtype) -> None:
    (run.path / "setup-ran").write_text(f"{device} {encoder_dtype}")
    raise DataError("vae/diffusion_pytorch_model.safetensors is truncated: download it again")


def killed(run, device, encoder_dtype) -> None:
    os.kill(os.getpid(), signal.SIGKILL)
