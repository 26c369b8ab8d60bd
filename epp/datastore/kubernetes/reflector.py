"""Kubernetes discovery, the reflector: one thread per watched collection that lists it,
watches from the list's resourceVersion, re-lists after ``410 Gone`` and backs off after
any failure. It never exits on an error; it hands every change to a callback."""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client, watch

from epp.datastore.kubernetes.objects import RawObject, WatchTiming

log = logging.getLogger(__name__)

@dataclass(slots=True, frozen=True)
class _Listed:
    items: tuple[RawObject, ...]


@dataclass(slots=True, frozen=True)
class _Changed:
    type: str  # ADDED | MODIFIED | DELETED
    object: RawObject


_Delta = _Listed | _Changed


class _Expired(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


def describe_error(exc: BaseException) -> str:
    if isinstance(exc, client.ApiException):
        message = ""
        with contextlib.suppress(ValueError, AttributeError):
            message = json.loads(exc.body or "{}").get("message", "")
        return f"HTTP {exc.status} {exc.reason or ''}{': ' + message if message else ''}".strip()
    return f"{type(exc).__name__}: {exc}"


@dataclass(slots=True, eq=False)
class _Reflector:
    """Keeps one collection in sync: list, watch from its resourceVersion, repeat."""

    name: str
    list_call: Callable[..., Any]
    deliver: Callable[[_Delta], None]
    report_error: Callable[[str], None]
    timing: WatchTiming
    label_selector: str = ""
    field_selector: str = ""
    _stopped: threading.Event = field(default_factory=threading.Event)
    _watch: watch.Watch | None = None
    _last_error: str = ""
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"k8s-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        w = self._watch
        if w is not None:
            w.stop()  # shuts the socket down, which unblocks the read

    def join(self, timeout_s: float) -> bool:
        thread = self._thread
        if thread is None:
            return True
        deadline = time.monotonic() + timeout_s
        while thread.is_alive() and time.monotonic() < deadline:
            # A watch that was still connecting when stop() ran had no socket to shut
            # down yet (and Watch.stream clears its stop flag when it starts): try again.
            self.stop()
            thread.join(0.05)
        return not thread.is_alive()

    def _selectors(self) -> dict[str, str]:
        kwargs = {}
        if self.label_selector:
            kwargs["label_selector"] = self.label_selector
        if self.field_selector:
            kwargs["field_selector"] = self.field_selector
        return kwargs

    def _run(self) -> None:
        delay = self.timing.backoff_initial_s
        while not self._stopped.is_set():
            try:
                version = self._list()
                delay = self.timing.backoff_initial_s
                self._last_error = ""
                while not self._stopped.is_set():
                    version = self._watch_from(version)
            except _Expired:
                log.info("%s: watch expired (410 Gone), listing again", self.name)
                continue
            except Exception as exc:
                if self._stopped.is_set():
                    break
                text = describe_error(exc)
                self.report_error(text)
                # The same failure again (say, a CRD that is not installed) goes to debug.
                level = logging.DEBUG if text == self._last_error else logging.WARNING
                self._last_error = text
                log.log(level, "%s: %s; retrying in %.2fs", self.name, text, delay)
                self._stopped.wait(delay * random.uniform(0.8, 1.0))
                delay = min(delay * 2, self.timing.backoff_max_s)

    def _list(self) -> str:
        resp = self.list_call(
            **self._selectors(),
            _preload_content=False,
            _request_timeout=(self.timing.request_timeout_s, self.timing.request_timeout_s),
        )
        try:
            body = json.loads(resp.data)
        finally:
            resp.release_conn()
        version = str((body.get("metadata") or {}).get("resourceVersion") or "")
        if not version:
            raise ValueError("list response without metadata.resourceVersion")
        self.deliver(_Listed(tuple(body.get("items") or ())))
        return version

    def _watch_from(self, version: str) -> str:
        """Stream events until the server ends the watch; returns the version to resume at."""
        w = watch.Watch(return_type="object")  # plain dicts, no model classes
        self._watch = w
        try:
            if self._stopped.is_set():
                return version
            stream = w.stream(
                self.list_call,
                **self._selectors(),
                resource_version=version,
                allow_watch_bookmarks=True,
                timeout_seconds=self.timing.watch_timeout_s,
                _request_timeout=(
                    self.timing.request_timeout_s,
                    self.timing.watch_timeout_s + self.timing.request_timeout_s,
                ),
            )
            for event in stream:
                if self._stopped.is_set():
                    break
                kind = event.get("type")
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self.deliver(_Changed(kind, event["raw_object"]))
        except client.ApiException as exc:
            if exc.status == 410:
                raise _Expired() from exc
            raise
        finally:
            self._watch = None
        return str(w.resource_version or version)
