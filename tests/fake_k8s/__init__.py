"""A fake Kubernetes API server that speaks the list and watch wire format.

Enough of the API for the real ``kubernetes`` client to list and watch namespaced
collections: ``resourceVersion`` on lists and objects, ``?watch=true`` streams of
newline-delimited JSON events over chunked HTTP, label and field selectors (equality only),
``410 Gone`` for a watch that starts before the compacted history, server-side watch
timeouts, and the faults a real control plane shows: dropped watch connections, 5xx
answers, and a port that refuses connections for a while.
"""

from __future__ import annotations

from tests.fake_k8s.server import (
    CONFIGMAPS,
    OBJECTIVES,
    PODS,
    POOLS,
    FakeKubeApi,
    objective,
    pod,
    pool,
)

__all__ = ["CONFIGMAPS", "OBJECTIVES", "PODS", "POOLS", "FakeKubeApi", "objective", "pod", "pool"]
