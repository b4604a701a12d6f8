"""Foveal: an inference and serving engine for vision language models."""
from foveal.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch; keep `import foveal` light for the engine side.
    if name == "LLM":
        from foveal.llm import LLM

        return LLM
    raise AttributeError(name)
