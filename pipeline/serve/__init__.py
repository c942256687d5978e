"""``mode=serve``: an OpenAI-compatible HTTP server on the engine (``app``; ``bridge`` carries
each request's events from the engine's thread to the event loop)."""

from pipeline.serve.app import ServeSettings, create_app

__all__ = ["ServeSettings", "create_app"]
