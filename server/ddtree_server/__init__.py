"""ddtree-server: OpenAI-compatible server with exact DDTree / DFlash speculative decoding."""

__version__ = "0.1.0"
