"""The embedded server's request error: an OpenAI-style error body with its HTTP status. Its own module so
the app and vLLM's extract_hidden_states handler (``serve.extract``) both raise it without importing each other."""

from __future__ import annotations


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
