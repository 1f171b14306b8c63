"""Sampling: request parameters, per-batch tensors, and the batched sampler."""

from radixserve.engine.sampling.batch import SamplingBatch, SamplingRequest
from radixserve.engine.sampling.inputs import SamplingInput
from radixserve.engine.sampling.params import SamplingParams, resolve_seed
from radixserve.engine.sampling.sampler import SampleResult, sample

__all__ = [
    "SampleResult",
    "SamplingBatch",
    "SamplingInput",
    "SamplingParams",
    "SamplingRequest",
    "resolve_seed",
    "sample",
]
