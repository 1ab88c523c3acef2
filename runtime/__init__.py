"""The torch-free runtime: load a bundle and generate with exact speculative decoding."""
from .generator import GenerationResult, Generator

__all__ = ["Generator", "GenerationResult"]
