"""ZeRO-Pipe: plan, launch, run, monitor and export DeepSpeed ZeRO training on few-GPU clusters."""

__version__ = "0.1.0"
