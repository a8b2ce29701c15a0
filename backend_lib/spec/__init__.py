"""Speculative decoding (issue 34): proposers, configuration, and the exact verification."""
from .config import SpeculativeConfig, parse_speculative_config
from .decoder import SPECULATIVE_VALUES, SpecDecoder, VerifyRows
from .ngram import NgramProposer, propose_ngram

__all__ = ["SPECULATIVE_VALUES", "SpecDecoder", "SpeculativeConfig", "VerifyRows", "NgramProposer",
           "parse_speculative_config", "propose_ngram"]
