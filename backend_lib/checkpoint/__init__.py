"""Reading Qwen3 checkpoints: config.json, compressed-tensors quantization and safetensors weights."""
from .errors import CheckpointError
from .model_config import ModelConfig, MoeConfig
from .quantization import QuantScheme, parse_quantization_config
from .weights import WeightStore

__all__ = ["CheckpointError", "ModelConfig", "MoeConfig", "QuantScheme", "parse_quantization_config", "WeightStore"]
