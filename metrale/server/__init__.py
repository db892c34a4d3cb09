"""metrale's OpenAI-compatible HTTP server: an ASGI app (`ServerApp`) and `metrale serve`."""

from metrale.server.app import ServerApp

__all__ = ["ServerApp"]
