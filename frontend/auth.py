"""The API key check, one for both APIs: HTTP's `Authorization` header and gRPC's `authorization`
metadata carry the same `Bearer <key>` value. The key is compared in constant time and never
logged; with no key configured every call is let through."""

from __future__ import annotations

import hmac

from runtime.errors import Unauthenticated


class ApiKey:
    def __init__(self, key: str | None) -> None:
        self._key = key.encode() if key else None

    @property
    def required(self) -> bool:
        return self._key is not None

    def check(self, authorization: str | None, where: str) -> None:
        """Raise Unauthenticated unless `authorization` is `Bearer <key>`; `where` names the
        header or metadata in the message."""
        if self._key is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
            raise Unauthenticated(f"invalid or missing API key ({where}: Bearer <key>)")

    def __repr__(self) -> str:          # never the key itself
        return f"ApiKey(required={self.required})"
