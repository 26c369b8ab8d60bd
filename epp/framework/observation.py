"""What one epp replica saw of another replica's request: the observations the response
observer (``epp.extproc.observer``) publishes and index sync (``epp.sync``) carries between
replicas. They live on the ground floor so that sync does not stand on the Envoy transport."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum

__all__ = ["Kind", "Observation", "Publish"]


class Kind(IntEnum):
    """What a replica saw of another replica's request (the sync wire format's
    ``Observation.Kind`` has the same numbers)."""

    CLAIMED = 0
    """The observer stream has the request: the router stops waiting for one."""
    FIRST_BYTES = 1
    """The response's first body bytes came."""
    FINISHED = 2
    """The response is complete; the other fields say what it carried."""
    ENDED = 3
    """The observer stream ended before the response did (a client that left)."""


@dataclass(slots=True)
class Observation:
    """One observation of a peer's request, as the handoff publishes and applies it. How it
    travels is the publisher's business (index sync carries it, docs/sync.md)."""

    token: str
    kind: Kind
    age_s: float = 0.0
    """Seconds between the event and now (set by the receiver's transport)."""
    first_bytes_age_s: float = -1.0
    """Before sending: the first bytes' stamp (monotonic); received: their age; negative:
    no bytes came."""
    status: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = -1
    """Negative: the response did not say."""
    completion_tokens: int = 0
    response_bytes: int = 0
    generated_text: str = ""
    stored_ids: Sequence[str] = ()
    """FINISHED or ENDED: ids of objects the server stored for the request (a stored
    response), for the routing replica's ``Director.stored``."""


Publish = Callable[[Observation], None]
"""Sends an observation to the pool's other replicas (``SyncNode.publish_observation``)."""
