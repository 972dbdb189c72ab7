"""The web UI: a FastAPI app over the run store (``zeropipe ui``)."""

from zeropipe.server.app import create_app

__all__ = ["create_app"]
