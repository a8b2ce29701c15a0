from .params import RequestError, SamplingLimits, SamplingParams
from .sampler import Sampler

__all__ = ["RequestError", "SamplingLimits", "SamplingParams", "Sampler"]
