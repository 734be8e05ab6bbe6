"""A DLQ row's payload as an operator reads it: decoded by the content type its headers name."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(frozen=True)
class Payload:
    """A payload decoded by its content-type header: `json`, `text`, or `base64` bytes."""

    encoding: str
    value: Any

    @classmethod
    def decode(cls, body: bytes, content_type: str | None) -> Payload:
        kind = (content_type or "").split(";")[0].strip().lower()
        if kind == "application/json" or kind.endswith("+json"):
            try:
                return cls("json", orjson.loads(body))
            except orjson.JSONDecodeError:
                pass  # labelled JSON but is not: show what is there
        if kind.startswith("text/") or kind in ("application/json", ""):
            try:
                return cls("text", body.decode("utf-8"))
            except UnicodeDecodeError:
                pass
        return cls("base64", base64.b64encode(body).decode("ascii"))
