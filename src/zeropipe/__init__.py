"""ZeRO-Pipe: plan, launch, run, monitor and export DeepSpeed ZeRO training on few-GPU clusters."""

__version__ = "0.1.0"


def _quiet_known_noise() -> None:
    """Drop warnings users cannot act on: diffusers' pipelines import CLIP/SigLIP image processors,
    which fall back to their PIL versions without torchvision (ZeRO-Pipe uses neither); and
    bitsandbytes, imported by transformers wherever it is installed, says on CPUs with AVX512-BF16
    that it could not fetch an optional kernel from the Hub (its CPU 4-bit backend works without it)."""
    import logging

    logging.getLogger("transformers.utils.import_utils").addFilter(lambda record: "requires torchvision (not installed)" not in record.getMessage())
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(lambda record: "gemm_4bit_forward from kernels-community" not in record.getMessage())


_quiet_known_noise()
