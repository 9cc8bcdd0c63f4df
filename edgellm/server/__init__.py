"""The local OpenAI-compatible server (needs the ``serve`` extra: fastapi, uvicorn)."""

from __future__ import annotations

from edgellm.server.app import DEFAULT_MAX_BODY_BYTES, ApiError, create_app

__all__ = ["DEFAULT_MAX_BODY_BYTES", "ApiError", "create_app"]
