"""Async serving engine: AsyncLLM with the engine core in its own process."""
from foveal.async_engine.async_llm import AsyncLLM

__all__ = ["AsyncLLM"]
