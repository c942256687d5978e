"""Structured output and tools: response formats and tool-call rendering and parsing."""
