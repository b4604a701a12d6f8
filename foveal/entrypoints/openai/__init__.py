"""OpenAI-compatible HTTP server (`foveal serve`): FastAPI app over AsyncLLM."""
