"""Metric sinks: TensorBoard, Weights & Biases and MLflow, fed from rank 0's per-step records."""

from zeropipe.metrics.sinks import MetricSinks

__all__ = ["MetricSinks"]
