"""Parallelism by hand, checked against torch's own: data parallelism (`data`: gradient averaging,
bucketed and overlapped with the backward as torch DDP does)."""

from labkit.parallel.data import (
    AllReduceCounter,
    Bucket,
    BucketedDDP,
    Event,
    average_gradients,
    broadcast_parameters,
    count_allreduces,
)

__all__ = ["AllReduceCounter", "Bucket", "BucketedDDP", "Event", "average_gradients", "broadcast_parameters",
           "count_allreduces"]
