"""Bearer-key auth. No keys configured = auth disabled (local development default on 127.0.0.1).

Keys are compared with ``hmac.compare_digest`` against *every* configured key (no early exit), so
response timing reveals neither which key nor how much of a key matched.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import Request

from kvblend.config import ApiKey
from kvblend.server.errors import APIError


@dataclass(frozen=True)
class Principal:
    name: str
    namespace: str  # chunk-store tenant for GenerationRequest.namespace


ANONYMOUS = Principal(name="anonymous", namespace="")


class Authenticator:
    def __init__(self, keys: list[ApiKey]):
        self._keys = [
            (k.key.encode(), Principal(k.name or f"key{i}", k.namespace))
            for i, k in enumerate(keys)
        ]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None) -> Principal:
        if not self.enabled:
            return ANONYMOUS
        token = _bearer_token(authorization)
        if token is None:
            raise APIError(
                401,
                "You didn't provide an API key. You need to provide your API key in an "
                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
                "invalid_request_error",
                None,
                "missing_api_key",
            )
        given = token.encode()
        found: Principal | None = None
        for key, principal in self._keys:
            if hmac.compare_digest(given, key) and found is None:
                found = principal
        if found is None:
            raise APIError(
                401, "Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key"
            )
        return found

    async def __call__(self, request: Request) -> Principal:
        """FastAPI dependency."""
        return self.authenticate(request.headers.get("authorization"))


def _bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
