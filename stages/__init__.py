"""The stages of one inference, importable one by one: ``from stages import Prefill, Sampler``."""

from stages.audio_encoder import AudioEncoder
from stages.decode import DecodeLoop, Speculative
from stages.prefill import Prefill
from stages.sampler import Sampler
from stages.tokenize import Tokenize
from stages.vision_encoder import VisionEncoder

__all__ = ["Tokenize", "VisionEncoder", "AudioEncoder", "Prefill", "DecodeLoop", "Sampler", "Speculative"]
