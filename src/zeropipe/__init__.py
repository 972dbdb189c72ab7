"""ZeRO-Pipe: plan, launch, run, monitor and export DeepSpeed ZeRO training on few-GPU clusters."""

__version__ = "0.1.0"


def _quiet_known_noise() -> None:
    """Drop one warning users cannot act on: diffusers' pipelines import CLIP/SigLIP image processors,
    which fall back to their PIL versions without torchvision. ZeRO-Pipe uses neither."""
    import logging

    logging.getLogger("transformers.utils.import_utils").addFilter(lambda record: "requires torchvision (not installed)" not in record.getMessage())


_quiet_known_noise()
