from .engine_loop import EngineLoop
from .llm_engine import LLMEngine
from .messages import EngineStats, Request
from .outputs import RequestOutput

__all__ = ["EngineLoop", "EngineStats", "LLMEngine", "Request", "RequestOutput"]
