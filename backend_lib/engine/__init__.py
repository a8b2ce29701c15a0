from .engine_loop import EngineLoop
from .llm_engine import LLMEngine
from .outputs import RequestOutput

__all__ = ["EngineLoop", "LLMEngine", "RequestOutput"]
