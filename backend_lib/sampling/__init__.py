from .params import SamplingParams
from .sampler import Sample, SampleError, Sampler

__all__ = ["Sample", "SampleError", "SamplingParams", "Sampler"]
