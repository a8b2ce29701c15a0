"""LoRA adapters over the base model: PEFT adapter loading and validation (adapter.py), the registry of the
adapters a model serves with its LRU of resident ones (registry.py), and the per-row update inside the
forward (layer.py). See docs/lora.md."""
from .adapter import BaseShape, LoraAdapter, LoraError, load_adapter
from .registry import LoraRegistry, parse_lora_modules, read_multi_lora

__all__ = ["BaseShape", "LoraAdapter", "LoraError", "LoraRegistry", "load_adapter", "parse_lora_modules",
           "read_multi_lora"]
