"""HTTP header lists as Envoy hands them to ext_proc, and Envoy's header-mutation rules.

Headers are an ordered list of ``(lower-case name, value)`` pairs so repeated headers
survive. Request lists start with the pseudo-headers ``:authority``, ``:path``, ``:method``,
``:scheme``; response lists with ``:status``. Values travel in ``raw_value`` bytes, as Envoy
sends them since 1.27.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

log = logging.getLogger(__name__)

Header = tuple[str, str]

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
"""Connection-level headers a proxy never forwards (RFC 9110 section 7.6.1)."""

MUTABLE_PSEUDO = frozenset({":path", ":authority"})
"""Pseudo-headers an ext_proc server may rewrite; Envoy's default mutation rules reject the
others (``:method``, ``:scheme``, ``:status`` on requests)."""

_Action = base_pb2.HeaderValueOption.HeaderAppendAction
Names = set[str]


class HeaderList:
    __slots__ = ("items",)

    def __init__(self, items: Iterable[Header] = ()) -> None:
        self.items: list[Header] = list(items)

    @classmethod
    def from_mapping(
        cls, pseudo: Mapping[str, str], headers: Iterable[tuple[str, str]]
    ) -> HeaderList:
        out = cls(pseudo.items())
        for name, value in headers:
            key = name.lower()
            if key in HOP_BY_HOP or key == "host":
                continue
            out.items.append((key, value))
        return out

    def get(self, name: str) -> str | None:
        for k, v in self.items:
            if k == name:
                return v
        return None

    def set(self, name: str, value: str) -> None:
        self.remove(name)
        self.items.append((name, value))

    def add(self, name: str, value: str) -> None:
        self.items.append((name, value))

    def remove(self, name: str) -> bool:
        before = len(self.items)
        self.items = [(k, v) for k, v in self.items if k != name]
        return len(self.items) != before

    def regular(self) -> list[Header]:
        """Headers without the pseudo-headers, for the HTTP/1.1 hop."""
        return [(k, v) for k, v in self.items if not k.startswith(":")]

    def to_proto(self) -> base_pb2.HeaderMap:
        return base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in self.items]
        )

    def apply(self, mutation: pb.HeaderMutation) -> Names:
        """Apply an ext_proc ``HeaderMutation`` the way Envoy does (set, then remove).

        Returns the names the mutation set, so callers can tell whether the server took
        responsibility for ``content-length``."""
        touched: Names = Names()
        for option in mutation.set_headers:
            header = option.header
            key = header.key.lower()
            value = (
                header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
            )
            if key.startswith(":") and key not in MUTABLE_PSEUDO:
                log.warning("ext_proc tried to set %s; Envoy's default rules ignore it", key)
                continue
            if not value and not option.keep_empty_value:
                continue  # Envoy drops empty values unless keep_empty_value
            action = option.append_action
            if option.HasField("append"):  # the deprecated bool wins when present
                action = (
                    _Action.APPEND_IF_EXISTS_OR_ADD
                    if option.append.value
                    else _Action.OVERWRITE_IF_EXISTS_OR_ADD
                )
            touched.add(key)
            present = self.get(key) is not None
            if action == _Action.APPEND_IF_EXISTS_OR_ADD and not key.startswith(":"):
                self.add(key, value)
            elif action == _Action.ADD_IF_ABSENT:
                if not present:
                    self.add(key, value)
            elif action == _Action.OVERWRITE_IF_EXISTS:
                if present:
                    self.set(key, value)
            else:  # OVERWRITE_IF_EXISTS_OR_ADD, or a pseudo-header (single-valued)
                self.set(key, value)
        for name in mutation.remove_headers:
            key = name.lower()
            if key.startswith(":") or key == "host":
                log.warning("ext_proc tried to remove %s; Envoy ignores it", key)
                continue
            self.remove(key)
        return touched
