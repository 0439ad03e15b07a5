"""The package's version: the face exports it, and the handshake's ``hello`` names it."""

__version__ = "0.1.0"
