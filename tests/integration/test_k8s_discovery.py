"""Kubernetes discovery against a fake API server, through the real ``kubernetes`` client."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from epp.datastore.kubernetes import (
    DiscoveryError,
    KubernetesSource,
    WatchTiming,
    api_client_for,
)
from epp.datastore.store import Datastore
from epp.framework.endpoint import EndpointId
from tests.fake_k8s import OBJECTIVES, PODS, POOLS, FakeKubeApi, objective, pod, pool

FAST = WatchTiming(
    backoff_initial_s=0.02,
    backoff_max_s=0.2,
    watch_timeout_s=5,
    request_timeout_s=2.0,
    sync_timeout_s=5.0,
)
VLLM = {"app": "vllm"}


@pytest.fixture
def api() -> Iterator[FakeKubeApi]:
    fake = FakeKubeApi()
    for collection in (PODS(), POOLS(), OBJECTIVES()):
        fake.create_collection(collection)
    fake.start()
    yield fake
    fake.close()


@pytest.fixture
def datastore() -> Datastore:
    return Datastore()


@pytest.fixture
async def started(
    api: FakeKubeApi, datastore: Datastore
) -> AsyncIterator[Callable[..., asyncio.Future[KubernetesSource]]]:
    sources: list[KubernetesSource] = []

    async def start(**kwargs: object) -> KubernetesSource:
        kwargs.setdefault("timing", FAST)
        source = KubernetesSource(
            datastore,
            api_client=api_client_for(api.host),
            **kwargs,  # type: ignore[arg-type]
        )
        sources.append(source)
        await source.start()
        return source

    yield start  # type: ignore[misc]
    for source in sources:
        await source.stop()


def ids(datastore: Datastore) -> set[str]:
    return {e.id for e in datastore.snapshot()}


async def eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll until ``check`` holds; fail with the last state otherwise."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def test_pool_pods_join_and_leave_with_readiness(api, datastore, started) -> None:
    api.put(POOLS(), pool("llama", VLLM, [8000]))
    api.put(PODS(), pod("ready", "10.0.0.1"))
    api.put(PODS(), pod("starting", "10.0.0.2", ready=False))
    api.put(PODS(), pod("no-ip", None))
    api.put(PODS(), pod("stopping", "10.0.0.4", terminating=True))
    api.put(PODS(), pod("other-app", "10.0.0.5", {"app": "other"}))
    removed: list[EndpointId] = []
    datastore.on_removed(removed.append)

    source = await started(pool_name="llama")

    assert source.synced and datastore.synced
    assert ids(datastore) == {"10.0.0.1:8000"}
    ep = datastore.get(EndpointId("10.0.0.1:8000"))
    assert ep is not None and ep.metrics_port == 8000 and ep.labels["app"] == "vllm"

    api.put(PODS(), pod("starting", "10.0.0.2"))
    await eventually(lambda: ids(datastore) == {"10.0.0.1:8000", "10.0.0.2:8000"})

    api.put(PODS(), pod("ready", "10.0.0.1", ready=False))
    await eventually(lambda: ids(datastore) == {"10.0.0.2:8000"})
    assert removed == ["10.0.0.1:8000"]  # the prefix index hears about it

    api.put(PODS(), pod("starting", "10.0.0.2", terminating=True))
    await eventually(lambda: ids(datastore) == set())

    api.put(PODS(), pod("ready", "10.0.0.1"))
    await eventually(lambda: ids(datastore) == {"10.0.0.1:8000"})
    api.delete(PODS(), "ready")
    await eventually(lambda: ids(datastore) == set())


async def test_pod_churn_converges_to_the_final_state(api, datastore, started) -> None:
    api.put(POOLS(), pool("llama", VLLM, [8000]))
    await started(pool_name="llama")

    for i in range(40):
        api.put(PODS(), pod(f"p{i}", f"10.1.0.{i}", ready=i % 3 != 0))
    for i in range(0, 40, 2):
        api.delete(PODS(), f"p{i}")
    for i in range(0, 10, 2):  # replacements reuse the IPs of deleted pods
        api.put(PODS(), pod(f"q{i}", f"10.1.0.{i}"))
    for i in range(1, 40, 4):
        api.put(PODS(), pod(f"p{i}", f"10.1.0.{i}", ready=False))

    expected = {f"10.1.0.{i}:8000" for i in range(1, 40, 2) if i % 3 != 0 and i % 4 != 1}
    expected |= {f"10.1.0.{i}:8000" for i in range(0, 10, 2)}
    await eventually(lambda: ids(datastore) == expected)


async def test_engine_label_and_labels_reach_the_endpoint(api, datastore, started) -> None:
    api.put(POOLS(), pool("mixed", VLLM, [8000]))
    labels = {"app": "vllm", "inference.networking.k8s.io/engine-type": "sglang"}
    api.put(PODS(), pod("sg", "10.0.0.7", labels))
    api.put(PODS(), pod("vl", "10.0.0.8"))
    await started(pool_name="mixed")

    engines = {e.id: e.engine for e in datastore.snapshot()}
    assert engines == {"10.0.0.7:8000": "sglang", "10.0.0.8:8000": "vllm"}


async def test_pool_selector_and_port_changes_reevaluate_pods(api, datastore, started) -> None:
    api.put(POOLS(), pool("llama", {"app": "vllm", "model": "a"}, [8000]))
    api.put(PODS(), pod("a1", "10.0.0.1", {"app": "vllm", "model": "a"}))
    api.put(PODS(), pod("b1", "10.0.0.2", {"app": "vllm", "model": "b"}))
    source = await started(pool_name="llama")
    assert ids(datastore) == {"10.0.0.1:8000"}

    api.put(POOLS(), pool("llama", {"app": "vllm", "model": "b"}, [8000]))
    await eventually(lambda: ids(datastore) == {"10.0.0.2:8000"})
    # The new watch follows the new selector.
    api.put(PODS(), pod("b2", "10.0.0.3", {"app": "vllm", "model": "b"}))
    api.put(PODS(), pod("a2", "10.0.0.4", {"app": "vllm", "model": "a"}))
    await eventually(lambda: ids(datastore) == {"10.0.0.2:8000", "10.0.0.3:8000"})

    api.put(POOLS(), pool("llama", {"app": "vllm", "model": "b"}, [8001]))
    await eventually(lambda: ids(datastore) == {"10.0.0.2:8001", "10.0.0.3:8001"})
    assert source.pool_spec is not None and source.pool_spec.target_ports == (8001,)


async def test_deleted_pool_empties_the_datastore_until_it_returns(api, datastore, started) -> None:
    api.put(POOLS(), pool("llama", VLLM, [8000]))
    api.put(PODS(), pod("a", "10.0.0.1"))
    await started(pool_name="llama")

    api.delete(POOLS(), "llama")
    await eventually(lambda: ids(datastore) == set())
    api.put(POOLS(), pool("llama", VLLM, [8000]))
    await eventually(lambda: ids(datastore) == {"10.0.0.1:8000"})


async def test_watch_expiry_relists_and_sees_changes_the_watch_missed(
    api, datastore, started
) -> None:
    api.put(POOLS(), pool("llama", VLLM, [8000]))
    api.put(PODS(), pod("a", "10.0.0.1"))
    api.put(PODS(), pod("b", "10.0.0.2"))
    await started(pool_name="llama")
    lists_before = api.lists(PODS())

    # Changes whose events were compacted away: only a fresh list can reveal them.
    api.put(PODS(), pod("b", "10.0.0.2", ready=False), record=False)
    api.put(PODS(), pod("c", "10.0.0.3"), record=False)
    api.expire_watches()

    await eventually(lambda: ids(datastore) == {"10.0.0.1:8000", "10.0.0.3:8000"})
    assert api.lists(PODS()) > lists_before
    # And the watch resumes after the re-list.
    api.put(PODS(), pod("d", "10.0.0.4"))
    await eventually(lambda: "10.0.0.4:8000" in ids(datastore))


async def test_a_new_pod_at_a_reused_ip_seen_only_by_a_relist_is_another_server(
    api, datastore, started
) -> None:
    """The watch drops; before the re-list, pod a is deleted and pod b takes its IP. The
    re-list shows the same ip:port and no removal: the pod's UID says it is another server."""
    from epp.framework.endpoint import Metrics
    from epp.plugins.approxprefix import PrefixIndexConfig, PrefixProducer

    forgotten: list[str] = []
    resets: list[tuple[str, str]] = []
    index = PrefixProducer.from_params("approx", PrefixIndexConfig()).index
    datastore.on_removed(forgotten.append)
    datastore.on_removed(index.remove_endpoint)
    datastore.on_reset(lambda eid, why: resets.append((eid, why)))
    api.put(POOLS(), pool("llama", VLLM, [8000]))
    api.put(PODS(), pod("a", "10.0.0.1"))
    await started(pool_name="llama")
    eid = EndpointId("10.0.0.1:8000")
    old = datastore.get(eid)
    assert old is not None and old.instance
    datastore.update_metrics(eid, Metrics(waiting=7, kv_usage=0.9, scraped_at_s=1.0))
    index.record(eid, [1, 2, 3], 1.0)  # what pod a was sent
    generation = datastore.request_started(eid)  # a request in flight to pod a

    api.delete(PODS(), "a", record=False)
    api.put(PODS(), pod("b", "10.0.0.1"), record=False)
    api.expire_watches()  # the watch cannot resume: re-list

    await eventually(lambda: (e := datastore.get(eid)) is not None and e.instance != old.instance)
    assert forgotten == [eid] and resets == [(eid, "replaced")]
    new = datastore.get(eid)
    assert new is not None and not new.metrics.known and new.metrics.waiting == 0  # fresh
    assert index.chunks_of(eid) == {}  # an empty index entry
    assert datastore.in_flight()[eid] == 0
    datastore.request_finished(eid, generation)  # pod a's request ends: not pod b's count
    assert datastore.in_flight()[eid] == 0


async def test_dropped_watch_reconnects(api, datastore, started) -> None:
    api.put(POOLS(), pool("llama", VLLM, [8000]))
    await started(pool_name="llama")
    api.drop_watches()
    api.put(PODS(), pod("a", "10.0.0.1"))
    await eventually(lambda: ids(datastore) == {"10.0.0.1:8000"})


async def test_api_errors_then_recovery(api, datastore, started) -> None:
    api.put(POOLS(), pool("llama", VLLM, [8000]))
    api.put(PODS(), pod("a", "10.0.0.1"))
    await started(pool_name="llama")

    api.fail(500)
    api.put(PODS(), pod("a", "10.0.0.1", ready=False))
    api.put(PODS(), pod("b", "10.0.0.2"))
    lists_before = api.lists(PODS())
    await eventually(lambda: api.lists(PODS()) >= lists_before + 2)  # retrying, backing off
    assert ids(datastore) == {"10.0.0.1:8000"}  # last known state is kept meanwhile

    api.fail(None)
    await eventually(lambda: ids(datastore) == {"10.0.0.2:8000"})


async def test_connection_refused_then_recovery(api, datastore, started) -> None:
    api.put(POOLS(), pool("llama", VLLM, [8000]))
    api.put(PODS(), pod("a", "10.0.0.1"))
    await started(pool_name="llama")

    api.stop_listening()
    api.delete(PODS(), "a")
    api.put(PODS(), pod("b", "10.0.0.2"))
    api.start_listening()
    await eventually(lambda: ids(datastore) == {"10.0.0.2:8000"})


async def test_selector_without_pool(api, datastore, started) -> None:
    api.put(PODS(), pod("a", "10.0.0.1", {"app": "vllm", "tier": "gpu"}))
    api.put(PODS(), pod("b", "10.0.0.2", {"app": "vllm", "tier": "cpu"}))
    api.put(PODS(), pod("c", "10.0.0.3", {"app": "sglang", "tier": "gpu"}))
    await started(endpoint_selector="app=vllm,tier=gpu", target_ports=[8000, 8001])
    assert ids(datastore) == {"10.0.0.1:8000", "10.0.0.1:8001"}

    api.put(PODS(), pod("b", "10.0.0.2", {"app": "vllm", "tier": "gpu"}))
    await eventually(lambda: len(ids(datastore)) == 4)
    api.put(PODS(), pod("a", "10.0.0.1", {"app": "vllm", "tier": "cpu"}))  # relabelled away
    await eventually(lambda: ids(datastore) == {"10.0.0.2:8000", "10.0.0.2:8001"})


async def test_objective_priorities_follow_the_pool(api, started) -> None:
    api.put(POOLS(), pool("llama", VLLM, [8000]))
    api.put(OBJECTIVES(), objective("premium", "llama", 10))
    api.put(OBJECTIVES(), objective("other-pool", "mistral", 5))
    source = await started(pool_name="llama")
    objectives = source.objectives
    await eventually(lambda: objectives.priority_of("premium") == 10)
    assert objectives.priority_of("other-pool") is None

    api.put(OBJECTIVES(), objective("batch", "llama", -5))
    api.put(OBJECTIVES(), objective("plain", "llama", None))
    await eventually(lambda: objectives.priority_of("batch") == -5)
    await eventually(lambda: objectives.priority_of("plain") == 0)
    api.delete(OBJECTIVES(), "premium")
    await eventually(lambda: objectives.priority_of("premium") is None)


async def test_start_fails_clearly_when_the_pool_is_missing(api, datastore) -> None:
    source = KubernetesSource(
        datastore,
        pool_name="nope",
        api_client=api_client_for(api.host),
        timing=WatchTiming(backoff_initial_s=0.02, sync_timeout_s=0.5),
    )
    with pytest.raises(DiscoveryError, match="InferencePool default/nope not found"):
        await source.start()
    assert not datastore.synced


async def test_start_fails_clearly_when_the_api_refuses(api, datastore) -> None:
    api.fail(403)
    source = KubernetesSource(
        datastore,
        endpoint_selector="app=vllm",
        target_ports=[8000],
        api_client=api_client_for(api.host),
        timing=WatchTiming(backoff_initial_s=0.02, sync_timeout_s=0.5),
    )
    with pytest.raises(DiscoveryError, match="HTTP 403"):
        await source.start()


async def test_stop_ends_the_watch_threads(api, datastore) -> None:
    def watch_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("k8s-")}

    before = watch_threads()
    api.put(POOLS(), pool("llama", VLLM, [8000]))
    source = KubernetesSource(
        datastore, pool_name="llama", api_client=api_client_for(api.host), timing=FAST
    )
    await source.start()
    await eventually(lambda: api.open_watches == 3)  # pool, pods, objectives: all blocked
    assert len(watch_threads() - before) == 3
    await source.stop()
    assert watch_threads() - before == set()
