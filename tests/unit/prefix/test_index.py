from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.framework.endpoint import EndpointId
from epp.prefix import index as index_module
from epp.prefix import lru
from epp.prefix.index import PrefixIndex

A, B, C = EndpointId("10.0.0.1:8000"), EndpointId("10.0.0.2:8000"), EndpointId("10.0.0.3:8000")


@pytest.fixture(autouse=True, params=["python", "native"])
def store(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs against both per-endpoint stores (epp/prefix/lru.py)."""
    native = request.param == "native"
    if native and not lru.NATIVE:
        pytest.skip("native LRU extension not built on this machine")
    monkeypatch.setattr(index_module, "store_factory", lambda _=None: lru.store_factory(native))
    return str(request.param)


def chain(tag: int, n: int) -> list[int]:
    """A fake chain: equal tags and positions share hashes (tags model prompts)."""
    return [tag * 1_000_003 + i for i in range(n)]


def test_match_counts_leading_chunks_per_endpoint() -> None:
    idx = PrefixIndex()
    idx.record(A, chain(1, 10), now_s=1.0)
    idx.record(B, chain(1, 4), now_s=1.0)
    assert idx.match(chain(1, 10), [A, B, C], now_s=2.0) == {A: 10, B: 4}
    assert idx.match(chain(1, 6), [A, B, C], now_s=2.0) == {A: 6, B: 4}
    assert idx.match(chain(2, 6), [A, B, C], now_s=2.0) == {}


def test_fill_is_the_share_of_the_endpoints_lru_in_use() -> None:
    idx = PrefixIndex(capacity_chunks=400)
    assert idx.fill([A]) == [0.0]  # nothing recorded
    idx.record(A, chain(1, 100), now_s=1.0)
    assert idx.fill([A, B]) == [0.25, 0.0]
    idx.set_capacity(A, 200)
    assert idx.fill([A]) == [0.5]
    for tag in range(2, 10):
        idx.record(A, chain(tag, 100), now_s=float(tag))
    assert idx.fill([B, A]) == [0.0, 1.0]


def test_least_filled_follows_records_capacities_expiry_and_removal() -> None:
    idx = PrefixIndex(capacity_chunks=400, ttl_s=10.0)
    idx.record(A, chain(1, 300), now_s=1.0)
    idx.record(B, chain(2, 100), now_s=1.0)
    idx.record(C, chain(3, 200), now_s=5.0)
    assert idx.least_filled(3, {A, B, C}) == [B, C, A]
    assert idx.least_filled(1, {A, C}) == [C]  # only the endpoints asked about
    idx.set_capacity(C, 4000)  # a bigger cache: emptier
    assert idx.least_filled(2, {A, B, C}) == [C, B]
    idx.sweep(now_s=12.0)  # A's and B's entries expire
    assert idx.least_filled(3, {A, B, C})[-1] == C
    idx.remove_endpoint(C)
    assert C not in idx.least_filled(3, {A, B, C})


def test_partial_prefix_match_stops_at_divergence() -> None:
    idx = PrefixIndex()
    idx.record(A, chain(1, 8), now_s=1.0)
    request = chain(1, 5) + chain(9, 5)[5:] + [77, 78, 79]
    assert idx.match(request, [A], now_s=1.0) == {A: 5}


def test_capacity_keeps_the_most_recent_chains_and_drops_the_oldest() -> None:
    idx = PrefixIndex(capacity_chunks=400)
    for tag in range(100):  # 100 distinct prompts of 10 chunks into room for 40
        idx.record(A, chain(tag, 10), now_s=float(tag))
    assert len(idx) == 400
    held = [tag for tag in range(100) if idx.match(chain(tag, 10), [A], now_s=100.0)]
    assert held == list(range(60, 100))  # exactly the 40 most recent
    assert idx.stats().evictions == 600


def test_lru_evicts_the_deepest_chunks_of_the_oldest_chain_first() -> None:
    idx = PrefixIndex(capacity_chunks=10)
    idx.record(A, chain(1, 6), now_s=1.0)
    idx.record(A, chain(2, 6), now_s=2.0)  # 12 > 10: the two deepest chunks of chain 1 go
    assert idx.match(chain(1, 6), [A], now_s=3.0) == {A: 4}
    assert idx.match(chain(2, 6), [A], now_s=3.0) == {A: 6}
    idx.record(A, chain(1, 4), now_s=4.0)  # touch chain 1: chain 2 is now the oldest
    idx.record(A, chain(3, 3), now_s=5.0)
    assert idx.match(chain(1, 6), [A], now_s=6.0) == {A: 4}
    assert idx.match(chain(2, 6), [A], now_s=6.0) == {A: 3}


def test_a_chain_used_again_moves_instead_of_being_stored_twice() -> None:
    idx = PrefixIndex(capacity_chunks=400)
    idx.record(A, chain(0, 50), now_s=0.0)
    for tag in range(1, 30):
        idx.record(A, chain(tag, 10), now_s=float(tag))
        idx.record(A, chain(0, 50), now_s=float(tag))
    assert len(idx) == len(idx.chunks_of(A)) <= 400
    assert idx.match(chain(0, 50), [A], now_s=30.0) == {A: 50}


def test_reused_chain_survives_while_unused_ones_are_evicted() -> None:
    idx = PrefixIndex(capacity_chunks=400)
    for tag in range(1, 200):
        idx.record(A, chain(0, 10), now_s=float(tag))  # the shared system prompt
        idx.record(A, chain(tag, 10), now_s=float(tag))
    assert idx.match(chain(0, 10), [A], now_s=200.0) == {A: 10}
    assert idx.match(chain(1, 10), [A], now_s=200.0) == {}


def test_ttl_expiry_lazy_on_read_and_by_sweep() -> None:
    idx = PrefixIndex(ttl_s=10.0)
    idx.record(A, chain(1, 5), now_s=0.0)
    idx.record(A, chain(1, 2), now_s=8.0)
    assert idx.match(chain(1, 5), [A], now_s=9.0) == {A: 5}
    assert idx.match(chain(1, 5), [A], now_s=11.0) == {A: 2}  # lazy: still stored
    assert len(idx) == 5
    assert idx.sweep(now_s=11.0) == 3
    assert len(idx) == 2
    assert idx.sweep(now_s=30.0) == 2
    assert len(idx) == 0 and idx.stats().expirations == 5


def test_remove_endpoint_drops_all_its_entries() -> None:
    idx = PrefixIndex()
    idx.record(A, chain(1, 5), now_s=1.0)
    idx.record(B, chain(1, 5), now_s=1.0)
    assert idx.remove_endpoint(A) == 5
    assert idx.match(chain(1, 5), [A, B], now_s=1.0) == {B: 5}
    assert len(idx) == 5


def test_global_cap_evicts_the_oldest_entries_across_endpoints() -> None:
    idx = PrefixIndex(capacity_chunks=1000, max_entries=2000)
    for t in range(10):
        idx.record(A, chain(100 + t, 100), now_s=1.0 + t)
    for t in range(10):
        idx.record(B, chain(200 + t, 100), now_s=20.0 + t)
    for t in range(5):
        idx.record(C, chain(300 + t, 100), now_s=40.0 + t)
    assert len(idx) <= 2000
    assert idx.match(chain(100, 100), [A], now_s=50.0) == {}  # A's oldest went first
    assert idx.match(chain(304, 100), [C], now_s=50.0) == {C: 100}
    assert idx.match(chain(209, 100), [B], now_s=50.0) == {B: 100}


def test_set_capacity_shrinks_an_endpoint() -> None:
    idx = PrefixIndex(capacity_chunks=100)
    for t in range(10):
        idx.record(A, chain(t, 10), now_s=float(t))
    idx.set_capacity(A, 30)
    assert len(idx) <= 30 and idx.capacity(A) == 30
    assert idx.match(chain(9, 10), [A], now_s=10.0) == {A: 10}
    assert idx.match(chain(0, 10), [A], now_s=10.0) == {}


def test_a_prompt_longer_than_the_capacity_keeps_its_leading_chunks() -> None:
    idx = PrefixIndex(capacity_chunks=50)
    idx.record(A, chain(1, 80), now_s=1.0)
    assert idx.match(chain(1, 80), [A], now_s=1.0) == {A: 50}


def test_stats_count_lookups_and_hits() -> None:
    idx = PrefixIndex()
    idx.record(A, chain(1, 4), now_s=1.0)
    idx.match(chain(1, 8), [A], now_s=1.0)
    s = idx.stats()
    assert (s.lookups, s.lookup_chunks, s.hit_chunks) == (1, 8, 4)
    assert s.hit_ratio == 0.5 and s.entries == 4 and s.endpoints == 1 and s.approx_bytes > 0


def test_rejects_nonsense_bounds() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(capacity_chunks=0)


# --- property test: binary search equals "stop at the first miss"; bounds hold ----------

op_st = st.lists(
    st.tuples(
        st.sampled_from(["record", "record", "record", "sweep", "remove", "cap"]),
        st.sampled_from([A, B]),
        st.integers(0, 5),  # prompt tag
        st.integers(1, 12),  # chain length
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(op_st, st.integers(8, 40))
def test_index_behaves_like_a_reference_lru_and_match_equals_a_linear_scan(
    ops: list[tuple[str, EndpointId, int, int]], cap: int
) -> None:
    ttl = 6.0
    idx = PrefixIndex(capacity_chunks=cap, ttl_s=ttl)
    model: dict[EndpointId, dict[int, float]] = {A: {}, B: {}}  # insertion order = LRU order
    caps = {A: cap, B: cap}
    now = 0.0
    for kind, ep, tag, n in ops:
        now += 1.0
        hashes = chain(tag, n)
        if kind == "record":
            idx.record(ep, hashes, now)
            d = model[ep]
            for h in reversed(hashes[: caps[ep]]):
                d.pop(h, None)
                d[h] = now
        elif kind == "sweep":
            idx.sweep(now)
            for d in model.values():
                for h in [h for h, t in d.items() if t < now - ttl]:
                    del d[h]
        elif kind == "remove":
            idx.remove_endpoint(ep)
            model[ep] = {}
            caps[ep] = cap
        else:
            caps[ep] = max(1, n)
            idx.set_capacity(ep, caps[ep])
        for e in (A, B):
            d = model[e]
            while len(d) > caps[e]:
                del d[next(iter(d))]
            assert idx.chunks_of(e) == d
        for probe_tag in range(6):
            probe = chain(probe_tag, 12)
            got = idx.match(probe, [A, B], now)
            for e in (A, B):
                k = 0
                while k < len(probe) and model[e].get(probe[k], -1e9) >= now - ttl:
                    k += 1
                assert got.get(e, 0) == k
                # prefix-closed: nothing deeper is held past the first miss
                assert not any(idx.holds(e, h, now) for h in probe[k:])
    assert len(idx) == sum(len(d) for d in model.values())


def test_safe_under_a_concurrent_sweeper_thread() -> None:
    idx = PrefixIndex(capacity_chunks=500, max_entries=3000, ttl_s=50.0)
    stop = threading.Event()
    errors: list[BaseException] = []
    clock = {"now": 0.0}

    def sweeper() -> None:
        try:
            while not stop.is_set():
                idx.sweep(clock["now"])
                idx.stats()
                time.sleep(0)  # yield the GIL: a sweeper spinning with no pause starves the test
        except Exception as exc:
            errors.append(exc)

    t = threading.Thread(target=sweeper)
    t.start()
    try:
        for i in range(3000):
            clock["now"] = float(i) / 10
            ep = (A, B, C)[i % 3]
            idx.record(ep, chain(i % 40, 30), clock["now"])
            idx.match(chain((i + 1) % 40, 30), [A, B, C], clock["now"])
            if i % 500 == 0:
                idx.remove_endpoint(B)
    finally:
        stop.set()
        t.join()
    assert not errors
    stats = idx.stats()
    assert stats.entries == sum(len(idx.chunks_of(e)) for e in (A, B, C))
    assert stats.entries <= 3000


def test_lookups_only_visit_endpoints_that_recorded_the_chain_root() -> None:
    idx = PrefixIndex(capacity_chunks=20)
    idx.record(A, chain(1, 10), now_s=1.0)
    idx.record(B, chain(2, 10), now_s=1.0)
    assert idx.match(chain(1, 10), {A, B, C}, now_s=1.0) == {A: 10}
    assert idx.match(chain(1, 10), {B, C}, now_s=1.0) == {}  # A not a candidate this time
    idx.record(A, chain(3, 20), now_s=2.0)  # evicts chain 1 from A
    assert idx.match(chain(1, 10), {A, B}, now_s=2.0) == {}
    idx.remove_endpoint(B)
    assert idx.match(chain(2, 10), {A, B}, now_s=2.0) == {}
    assert idx.sweep(now_s=2.0) == 0 and idx.match(chain(3, 20), {A}, now_s=2.0) == {A: 20}


def test_an_uninitialised_native_store_raises_instead_of_crashing() -> None:
    """``LruChunks.__new__(LruChunks)`` has no table until ``__init__``: every method must
    raise, not read a NULL table (run in a child process: a crash would end pytest)."""
    import subprocess
    import sys

    if not lru.NATIVE:
        pytest.skip("native LRU extension not built on this machine")
    probe = (
        "from epp.prefix._lru import LruChunks\n"
        "calls = [lambda s: s.get(1), lambda s: s.record([1, 2], 1.0), lambda s: s.held([1], 0.0),\n"
        "         lambda s: s.sweep(1.0), lambda s: s.evict_oldest(1), lambda s: s.set_capacity(4),\n"
        "         lambda s: s.oldest_stamp(), lambda s: s.items()]\n"
        "for call in calls:\n"
        "    s = LruChunks.__new__(LruChunks)\n"
        "    try:\n"
        "        call(s)\n"
        "    except RuntimeError as exc:\n"
        "        assert 'not initialised' in str(exc), exc\n"
        "    else:\n"
        "        raise SystemExit('no error')\n"
        "s = LruChunks.__new__(LruChunks)\n"
        "assert len(s) == 0 and s.nbytes > 0\n"
        "s.__init__(8)\n"
        "s.record([1, 2], 1.0)\n"
        "assert s.get(1) == 1.0\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], check=False, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr)


def test_sweep_and_items_take_a_slice() -> None:
    """What the index's incremental passes use: a sweep of at most ``limit`` entries and the
    entries from a position on, oldest first, in both stores."""
    for native in (False, True):
        if native and not lru.NATIVE:
            continue
        s = lru.store_factory(native)(100)
        for i in range(10):
            s.record([i], float(i))
        assert s.items(3, 2) == [(3, 3.0), (4, 4.0)]
        assert s.items(8) == [(8, 8.0), (9, 9.0)] and s.items(20, 5) == []
        assert s.items(7, 2) == [(7, 7.0), (8, 8.0)]  # walked from the young end
        assert s.sweep(6.0, 4) == 4 and len(s) == 6
        assert s.sweep(6.0) == 2 and s.items(0, 1) == [(6, 6.0)]


def test_the_passes_over_the_index_run_in_bounded_slices() -> None:
    """A sweep, a removed endpoint's entries and a snapshot export each go ~1k entries a
    step, the lock taken per step: the loop serves requests between them (issue 70, item 12)."""
    from epp.prefix.index import SLICE_ITEMS

    idx = PrefixIndex(capacity_chunks=100_000, max_entries=1_000_000, ttl_s=10.0)
    for i in range(200):
        idx.record(A, chain(i, 50), now_s=float(i) / 100)  # 10,000 entries
        idx.record(B, chain(i, 50), now_s=100.0)
    whole = idx.export_endpoint(A)
    parts = list(idx.export_slices(A))
    assert len(parts) >= 10_000 // SLICE_ITEMS
    assert max(sum(len(w.hashes) for w in p.writes) for p in parts) <= SLICE_ITEMS
    assert [h for p in parts for w in p.writes for h in w.hashes] == [
        h for w in whole.writes for h in w.hashes]  # fmt: skip
    assert sorted(r for p in parts for r in p.roots) == sorted(whole.roots)
    steps = list(idx.sweep_steps(now_s=50.0))
    assert max(steps) <= SLICE_ITEMS and sum(steps) == 10_000 and len(idx) == 10_000
    assert idx.remove_endpoint(B) == 10_000 and len(idx) == 0
    freeing = list(idx.sweep_steps(now_s=50.0))
    assert len(freeing) >= 10_000 // SLICE_ITEMS and not idx._retired
