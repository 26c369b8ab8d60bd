"""The fake API server (see the package docstring) and builders for the objects it serves."""

from __future__ import annotations

import contextlib
import copy
import json
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

Obj = dict[str, Any]


def PODS(ns: str = "default") -> str:
    return f"/api/v1/namespaces/{ns}/pods"


def POOLS(ns: str = "default") -> str:
    return f"/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools"


def OBJECTIVES(ns: str = "default") -> str:
    return f"/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/{ns}/inferenceobjectives"


def CONFIGMAPS(ns: str = "default") -> str:
    return f"/api/v1/namespaces/{ns}/configmaps"


_LIST_KIND = {
    "pods": ("v1", "PodList"),
    "configmaps": ("v1", "ConfigMapList"),
    "inferencepools": ("inference.networking.k8s.io/v1", "InferencePoolList"),
    "inferenceobjectives": ("inference.networking.x-k8s.io/v1alpha2", "InferenceObjectiveList"),
}


def pod(
    name: str,
    ip: str | None,
    labels: dict[str, str] | None = None,
    *,
    ready: bool = True,
    terminating: bool = False,
) -> Obj:
    meta: Obj = {"name": name, "labels": dict(labels or {"app": "vllm"})}
    if terminating:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    status: Obj = {
        "phase": "Running",
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ],
    }
    if ip:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": status}


def pool(name: str, match_labels: dict[str, str], ports: list[int]) -> Obj:
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name},
        "spec": {
            "selector": {"matchLabels": dict(match_labels)},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"name": f"{name}-epp", "port": {"number": 9002}},
        },
    }


def objective(name: str, pool_name: str, priority: int | None) -> Obj:
    spec: Obj = {"poolRef": {"name": pool_name}}
    if priority is not None:
        spec["priority"] = priority
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
        "kind": "InferenceObjective",
        "metadata": {"name": name},
        "spec": spec,
    }


@dataclass(slots=True, frozen=True)
class _Event:
    rv: int
    collection: str
    type: str
    obj: Obj
    old: Obj | None


def _parse_selector(text: str) -> list[tuple[str, str, str]]:
    terms = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        for op in ("!=", "==", "="):
            if op in term:
                key, value = term.split(op, 1)
                terms.append((key.strip(), op, value.strip()))
                break
        else:
            raise ValueError(f"unsupported selector term {term!r}")
    return terms


def _matches(
    obj: Obj, labels: list[tuple[str, str, str]], fields: list[tuple[str, str, str]]
) -> bool:
    meta = obj.get("metadata") or {}
    have = meta.get("labels") or {}
    for key, op, value in labels:
        if (have.get(key) == value) != (op != "!="):
            return False
    for key, op, value in fields:
        if key != "metadata.name":
            raise ValueError(f"unsupported field selector {key!r}")
        if (meta.get("name") == value) != (op != "!="):
            return False
    return True


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients hang up mid-stream on purpose; nothing to report


class FakeKubeApi:
    """Serve namespaced collections on 127.0.0.1 at a free port; ``host`` is its URL."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._rv = 1000
        self._floor = 0  # a watch from a version below this gets 410 Gone
        self._collections: dict[str, dict[str, Obj]] = {}
        self._events: list[_Event] = []
        self._epoch = 0  # bumped to cut every open watch
        self._expiries = 0  # bumped to send 410 to every open watch
        self._status: int | None = None
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0
        self.requests: list[tuple[str, dict[str, list[str]]]] = []
        self.open_watches = 0

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> FakeKubeApi:
        server = _Server(("127.0.0.1", self.port), _Handler)
        server.api = self  # type: ignore[attr-defined]
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        with self._cond:
            self._epoch += 1
            self._cond.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def host(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop_listening(self) -> None:
        """Cut open watches and close the port: clients get connection refused."""
        self.close()

    def start_listening(self) -> None:
        self.start()  # same port

    def fail(self, status: int | None) -> None:
        """Answer every request with ``status`` (None: serve again); cuts open watches."""
        with self._cond:
            self._status = status
            self._epoch += 1
            self._cond.notify_all()

    def drop_watches(self) -> None:
        """Close every open watch connection mid-stream, without the final chunk."""
        with self._cond:
            self._epoch += 1
            self._cond.notify_all()

    def expire_watches(self) -> None:
        """Compact the history: open watches get 410 Gone, and so does resuming them."""
        with self._cond:
            self._rv += 1
            self._floor = self._rv
            self._expiries += 1
            self._cond.notify_all()

    def lists(self, collection: str) -> int:
        """How many list (not watch) requests the collection has served."""
        with self._cond:
            return sum(
                1
                for path, q in self.requests
                if path == collection and q.get("watch", [""])[0].lower() != "true"
            )

    # --- objects ---------------------------------------------------------------------------

    def create_collection(self, collection: str) -> None:
        with self._cond:
            self._collections.setdefault(collection, {})

    def put(self, collection: str, obj: Obj, *, record: bool = True) -> Obj:
        """Create or replace an object. ``record=False`` changes it without a watch event,
        as if the event fell into history that was compacted away."""
        obj = copy.deepcopy(obj)
        with self._cond:
            self._rv += 1
            meta = obj.setdefault("metadata", {})
            meta["resourceVersion"] = str(self._rv)
            meta.setdefault("namespace", collection.split("/namespaces/")[1].split("/")[0])
            items = self._collections.setdefault(collection, {})
            old = items.get(meta["name"])
            # as the API server: a new object gets a UID, an update keeps it
            meta.setdefault("uid", old["metadata"]["uid"] if old is not None else str(uuid.uuid4()))
            items[meta["name"]] = obj
            if record:
                kind = "ADDED" if old is None else "MODIFIED"
                self._events.append(_Event(self._rv, collection, kind, obj, old))
            self._cond.notify_all()
        return obj

    def delete(self, collection: str, name: str, *, record: bool = True) -> None:
        """Delete an object; ``record=False``: without a watch event (see ``put``)."""
        with self._cond:
            old = self._collections[collection].pop(name)
            self._rv += 1
            gone = copy.deepcopy(old)
            gone["metadata"]["resourceVersion"] = str(self._rv)
            if record:
                self._events.append(_Event(self._rv, collection, "DELETED", gone, old))
            self._cond.notify_all()

    # --- request handling (handler threads) ------------------------------------------------

    def _list(self, collection: str, labels: list[Any], fields: list[Any]) -> Obj:
        with self._cond:
            items = [
                copy.deepcopy(o)
                for o in self._collections[collection].values()
                if _matches(o, labels, fields)
            ]
            version = str(self._rv)
        api_version, kind = _LIST_KIND[collection.rsplit("/", 1)[1]]
        return {
            "apiVersion": api_version,
            "kind": kind,
            "metadata": {"resourceVersion": version},
            "items": items,
        }

    def _watch_events(
        self,
        handler: _Handler,
        collection: str,
        since: int,
        labels: list[Any],
        fields: list[Any],
        timeout_s: float,
    ) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if self._status is not None:
                # fail() came between the request's status check and here: a watch opened
                # before the outage must not stream what happens during it
                handler.cut()
                return
            epoch, expiries = self._epoch, self._expiries
            cursor = len(self._events)
            for i, event in enumerate(self._events):
                if event.rv > since:
                    cursor = i
                    break
            gone = since < self._floor
            self.open_watches += 1
        try:
            if gone:
                handler.write_event(_gone(since))
                handler.end_stream()
                return
            while True:
                with self._cond:
                    while (
                        cursor == len(self._events)
                        and epoch == self._epoch
                        and expiries == self._expiries
                        and time.monotonic() < deadline
                    ):
                        self._cond.wait(deadline - time.monotonic())
                    batch = self._events[cursor:]
                    cursor = len(self._events)
                    dropped = epoch != self._epoch
                    expired = expiries != self._expiries
                if dropped:
                    handler.cut()
                    return
                for event in batch:
                    if event.collection == collection:
                        out = _visible(event, labels, fields)
                        if out is not None:
                            handler.write_event(out)
                if expired:
                    handler.write_event(_gone(since))
                    handler.end_stream()
                    return
                if time.monotonic() >= deadline:
                    handler.end_stream()
                    return
        except OSError:  # the client went away
            return
        finally:
            with self._cond:
                self.open_watches -= 1


def _gone(since: int) -> Obj:
    return {
        "type": "ERROR",
        "object": {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "message": f"too old resource version: {since}",
            "reason": "Expired",
            "code": 410,
        },
    }


def _visible(event: _Event, labels: list[Any], fields: list[Any]) -> Obj | None:
    """The event as a selector-filtered watch sees it: an object leaving the selection
    is DELETED for that watch, one entering it is ADDED."""
    now = _matches(event.obj, labels, fields)
    before = event.old is not None and _matches(event.old, labels, fields)
    if event.type == "DELETED":
        kind = "DELETED" if before else None
    elif now and before:
        kind = "MODIFIED"
    elif now:
        kind = "ADDED"
    elif before:
        kind = "DELETED"
    else:
        kind = None
    return None if kind is None else {"type": kind, "object": event.obj}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ThreadingHTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    @property
    def api(self) -> FakeKubeApi:
        return self.server.api  # type: ignore[attr-defined, no-any-return]

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        api = self.api
        with api._cond:
            api.requests.append((url.path, query))
            status = api._status
            known = url.path in api._collections
        if status is not None:
            self._status(status, "InternalError", "the fake API server is failing on purpose")
            return
        if not known:
            self._status(404, "NotFound", "the server could not find the requested resource")
            return
        labels = _parse_selector(query.get("labelSelector", [""])[0])
        fields = _parse_selector(query.get("fieldSelector", [""])[0])
        if query.get("watch", [""])[0].lower() == "true":
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            since = int(query.get("resourceVersion", ["0"])[0] or 0)
            timeout_s = float(query.get("timeoutSeconds", ["60"])[0])
            api._watch_events(self, url.path, since, labels, fields, timeout_s)
            return
        body = json.dumps(api._list(url.path, labels, fields)).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _status(self, code: int, reason: str, message: str) -> None:
        body = json.dumps(
            {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "message": message,
                "reason": reason,
                "code": code,
            }
        ).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def write_event(self, event: Obj) -> None:
        line = json.dumps(event).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
        self.wfile.flush()

    def end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def cut(self) -> None:
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)
