from .params import RequestError, SamplingLimits, SamplingParams
from .sampler import Sample, SampleError, Sampler

__all__ = ["RequestError", "Sample", "SampleError", "SamplingLimits", "SamplingParams", "Sampler"]
