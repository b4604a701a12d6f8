"""Foveal: an inference and serving engine for vision language models."""
from foveal.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["AsyncLLM", "LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch; keep `import foveal` light for the engine side.
    if name == "LLM":
        from foveal.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from foveal.async_engine import AsyncLLM

        return AsyncLLM
    raise AttributeError(name)
