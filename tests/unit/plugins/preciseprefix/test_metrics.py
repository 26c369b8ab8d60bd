"""The precise producer's counters as Prometheus families (read at scrape time)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from epp.framework.endpoint import Endpoint, EndpointId
from epp.framework.request import ApiKind, InferenceRequest
from epp.plugins.preciseprefix import PreciseIndexConfig, PrecisePrefixProducer
from epp.plugins.preciseprefix.events import EventBatch, Kind, KvEvent
from epp.plugins.preciseprefix.metrics import PreciseCollector
from tests.wordlevel import write_tokenizer


def test_counters_are_exported_with_their_labels() -> None:
    p = PrecisePrefixProducer("precise", PreciseIndexConfig())
    eid = EndpointId("10.0.0.1:8000")
    p.observe_endpoint(Endpoint(eid, "10.0.0.1", 8000))
    p.apply(eid, EventBatch("t", 0, 0.0, [KvEvent(Kind.STORED, [1, 2], "GPU", None, 16),
                                           KvEvent(Kind.REMOVED, [2], "GPU")]), 0.0)  # fmt: skip
    p.apply(eid, EventBatch("t", 5, 0.0, []), 1.0)  # a gap, no replay: a resync
    p.drop(eid, "bad-message")
    registry = CollectorRegistry()
    registry.register(PreciseCollector(p))
    get = registry.get_sample_value
    assert get("epp_kv_events_total", {"endpoint": eid, "type": "BlockStored"}) == 1
    assert get("epp_kv_events_total", {"endpoint": eid, "type": "BlockRemoved"}) == 1
    assert get("epp_kv_events_dropped_total", {"endpoint": eid, "reason": "bad-message"}) == 1
    assert get("epp_kv_events_gaps_total", {"endpoint": eid}) == 1
    assert get("epp_kv_events_resyncs_total", {"endpoint": eid}) == 1
    assert get("epp_precise_index_blocks") == 0  # the resync dropped what was left
    assert get("epp_precise_tokenize_seconds_count") == 0


def test_key_cache_counters_are_exported(tmp_path: Path) -> None:
    params = PreciseIndexConfig(block_size=2, tokenizers={"m": str(write_tokenizer(tmp_path / "t"))})
    p = PrecisePrefixProducer.from_params("precise", params)
    msgs = [{"role": "user", "content": "hello world how are you"}]
    for _ in range(2):  # the second turn reuses the first's pieces
        body = {"model": "m", "messages": msgs}
        assert not isinstance(p.keyer.keys(InferenceRequest("r", "m", "", api=ApiKind.CHAT, body=body)), str)
        msgs = [*msgs, {"role": "assistant", "content": "the parcel"}, {"role": "user", "content": "late"}]
    registry = CollectorRegistry()
    registry.register(PreciseCollector(p))
    get = registry.get_sample_value
    assert get("epp_precise_key_cache_tokens_total", {"source": "reused"}) == 7  # <s><|user|> ... <|assistant|>
    assert (get("epp_precise_key_cache_tokens_total", {"source": "encoded"}) or 0) > 7
    assert (get("epp_precise_key_cache_nodes") or 0) > 3
    assert get("epp_precise_key_cache_verifications_total", {"outcome": "mismatch"}) == 0
