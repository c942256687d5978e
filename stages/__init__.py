"""The stages of one inference, importable one by one: ``from stages import Prefill, Sampler``."""
from stages.decode import DecodeLoop
from stages.prefill import Prefill
from stages.sampler import Sampler
from stages.tokenize import Tokenize

__all__ = ["Tokenize", "Prefill", "DecodeLoop", "Sampler"]
