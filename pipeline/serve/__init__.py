"""``mode=serve``: an OpenAI-compatible HTTP server on the engine (``app``; ``bridge`` carries
each request's events from the engine's thread to the event loop)."""

from pipeline.serve.app import create_app
from pipeline.serve.protocol import ServeSettings

__all__ = ["ServeSettings", "create_app"]
