"""What can go wrong with a model server, as exceptions: each message names the URL (its
password masked, ``http://user:***@host``) and what to do.
"""

from __future__ import annotations

from llama_index.packs.self_rag_rse.common.urls import mask_url


class ServerError(RuntimeError):
    """A model server could not be used; the message names the URL and the fix. A password in
    the URL is masked in both (``http://user:***@host``).
    """

    def __init__(self, message: str, url: str) -> None:
        super().__init__(mask_url(message))
        self.url = mask_url(url)


class ServerUnavailable(ServerError):
    """Nothing answered at the URL (connection refused, unknown host)."""


class ServerTimeout(ServerError):
    """The server did not answer within the timeout."""


class ServerHTTPError(ServerError):
    """The server answered with an HTTP error status."""

    def __init__(self, message: str, url: str, status: int, body: str) -> None:
        super().__init__(message, url)
        self.status = status
        self.body = body


class ServerNotReady(ServerHTTPError):
    """HTTP 429, 502, 503 or 504: the server, or a proxy before it, cannot answer yet
    (llama-server while it loads its model, a server restarting, rate limits): try again.
    """


class ServerRedirect(ServerError):
    """The server answered with a redirect (HTTP 3xx), which the client does not follow."""

    def __init__(self, message: str, url: str, status: int, location: str | None) -> None:
        super().__init__(message, url)
        self.status = status
        self.location = location


class MalformedResponse(ServerError):
    """The server answered 200 with a body that is not what the API promises."""
