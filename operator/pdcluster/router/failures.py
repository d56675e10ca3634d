"""How an attempt ends when it does not answer: `Retry` (another engine may succeed) or
`Refused` (the engine refused the request itself), and the router's error answer."""

from __future__ import annotations

from pdcluster.router import openai
from pdcluster.router.http_messages import Response
from pdcluster.router.membership import Upstream

JSON = "application/json"


def error(
    status: int, message: str, param: str | None = None, headers: list[tuple[str, str]] | None = None
) -> Response:
    return Response(status, openai.error_body(status, message, param), JSON, headers)


class Retry(Exception):
    """An attempt failed where another engine may succeed."""

    def __init__(self, upstream: Upstream, reason: str, mid_stream: bool = False):
        super().__init__(reason)
        self.upstream = upstream
        self.reason = reason
        self.mid_stream = mid_stream


class Refused(Exception):
    """An engine refused the request itself (e.g. too long for max_model_len): that is
    the client's answer, on any engine."""

    def __init__(self, response: Response):
        self.response = response
