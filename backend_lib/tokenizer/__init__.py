from .detokenizer import IncrementalDetokenizer
from .stop import StopMatcher
from .tokenizer import Tokenizer, TokenizerError

__all__ = ["IncrementalDetokenizer", "StopMatcher", "Tokenizer", "TokenizerError"]
