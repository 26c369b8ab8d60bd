from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from epp.prefix.hasher import NATIVE, ChunkHasher, chain_seed

H = ChunkHasher(block_chars=8)
SEED = chain_seed("m")

text_st = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=200)


def test_trailing_partial_chunk_is_not_hashed() -> None:
    assert len(H.hashes("a" * 7, SEED)) == 0
    assert len(H.hashes("a" * 8, SEED)) == 1
    assert len(H.hashes("a" * 23, SEED)) == 2


@given(text_st, text_st)
def test_chain_property_equal_hash_iff_equal_prefix(a: str, b: str) -> None:
    ha, hb = H.hashes(a, SEED), H.hashes(b, SEED)
    for i in range(min(len(ha), len(hb))):
        same_prefix = a[: 8 * (i + 1)] == b[: 8 * (i + 1)]
        assert (ha[i] == hb[i]) == same_prefix


@given(text_st, st.text(max_size=50))
def test_shared_prefix_shares_exactly_its_full_chunks(prefix: str, tail: str) -> None:
    full = len(prefix) // 8
    a = H.hashes(prefix + tail, SEED)
    b = H.hashes(prefix, SEED)
    assert a[:full] == b[:full]


def test_same_chunk_text_at_other_position_hashes_differently() -> None:
    hs = H.hashes("abcdefgh" * 3, SEED)
    assert len(set(hs)) == 3


def test_model_adapter_and_salt_isolate_chains() -> None:
    text = "x" * 64
    seeds = {
        chain_seed("m"),
        chain_seed("m2"),
        chain_seed("m", "lora-a"),
        chain_seed("m", "", "tenant-1"),
        chain_seed("m", "lora-a", "tenant-1"),
    }
    assert len(seeds) == 5
    firsts = {H.hashes(text, s)[0] for s in seeds}
    assert len(firsts) == 5


@given(text_st, st.integers(min_value=0, max_value=10))
def test_extend_continues_the_chain(text: str, k: int) -> None:
    whole = H.hashes(text, SEED)
    k = min(k, len(whole))
    start_seed = whole[k - 1] if k else SEED
    assert whole[:k] + H.extend(text, start_seed, 8 * k) == whole


def test_non_ascii_chunks_are_characters_not_bytes() -> None:
    # 8 characters of 3 UTF-8 bytes each: one chunk of 8 characters.
    assert len(H.hashes("日本語のテキスト", SEED)) == 1


def test_max_chunks_caps_the_hashed_prefix() -> None:
    capped = ChunkHasher(block_chars=8, max_chunks=3)
    assert capped.hashes("y" * 800, SEED) == H.hashes("y" * 800, SEED)[:3]
    assert ChunkHasher(8).hashes("y" * 800, SEED)[:3] == capped.hashes("y" * 800, SEED)


@pytest.mark.skipif(not NATIVE, reason="native hashing extension not built on this machine")
@given(text_st, st.integers(1, 16), st.integers(0, 2**64 - 1), st.integers(0, 5), st.integers(0, 30))
def test_native_loop_equals_the_python_loop(
    text: str, block: int, seed: int, start_blocks: int, max_chunks: int
) -> None:
    native = ChunkHasher(block_chars=block, max_chunks=max_chunks, native=True)
    start = start_blocks * block
    assert native.extend(text, seed, start) == native.extend_python(text, seed, start)


# long ASCII runs broken by 2-, 3- and 4-byte characters: the native loop skips ASCII eight
# bytes at a time and must land on the same character boundaries
mostly_ascii = st.lists(
    st.one_of(st.text(alphabet="abc xyz", min_size=1, max_size=40), st.sampled_from(["é", "日本", "🚀", "Ω"])),
    max_size=40,
).map("".join)


@pytest.mark.skipif(not NATIVE, reason="native hashing extension not built on this machine")
@given(mostly_ascii, st.integers(1, 70), st.integers(0, 3))
def test_native_word_skipping_equals_the_python_loop(text: str, block: int, start_blocks: int) -> None:
    native = ChunkHasher(block_chars=block, native=True)
    start = start_blocks * block
    assert native.extend(text, 7, start) == native.extend_python(text, 7, start)


# each storage width of a str (Latin-1, BMP, astral) with ASCII runs long enough for the
# native encoder's word-at-a-time steps, and blocks larger than its stack buffer
per_kind = st.sampled_from(["é", "ÿ", "Ω", "日本", "\uffff", "🚀", "\U0010ffff"]).flatmap(
    lambda wide: st.lists(
        st.one_of(st.text(alphabet="abcdefgh ", min_size=1, max_size=30), st.just(wide)),
        max_size=30,
    ).map("".join)
)


@pytest.mark.skipif(not NATIVE, reason="native hashing extension not built on this machine")
@given(per_kind, st.sampled_from([1, 3, 8, 64, 300]), st.integers(0, 2))
def test_native_encoding_per_storage_width_equals_the_python_loop(
    text: str, block: int, start_blocks: int
) -> None:
    native = ChunkHasher(block_chars=block, native=True)
    start = start_blocks * block
    assert native.extend(text, 11, start) == native.extend_python(text, 11, start)


@pytest.mark.parametrize("native", [pytest.param(True, marks=pytest.mark.skipif(
    not NATIVE, reason="native hashing extension not built on this machine")), False])
@pytest.mark.parametrize("text", ["ab\ud800cdefgh", "abcd\U0001f680\udfffxyz", "abcdé\udc00xyzw"])
def test_a_lone_surrogate_in_a_hashed_chunk_raises_the_codec_error(native: bool, text: str) -> None:
    hasher = ChunkHasher(block_chars=4, native=native)
    with pytest.raises(UnicodeEncodeError, match="surrogates not allowed"):
        hasher.hashes(text, SEED)
    assert hasher.hashes(text[:2], SEED) == []  # a trailing partial chunk is never encoded


def test_a_native_loop_that_disagrees_with_xxhash_is_not_used(caplog: pytest.LogCaptureFixture) -> None:
    """A C loop linked against an XXH3 of another output (libxxhash before 0.8.0) would key
    every chunk differently from the replicas on the Python path: the import-time self-test
    refuses it and the hasher falls back to the Python loop."""
    from epp.prefix import hasher

    def older_xxh3(text: str, block: int, seed: int, start: int, max_chunks: int) -> list[int]:
        return [h ^ 1 for h in hasher._python_chain(text, block, seed, start, max_chunks)]

    def broken(text: str, block: int, seed: int, start: int, max_chunks: int) -> list[int]:
        raise SystemError("bad build")

    with caplog.at_level("WARNING", logger="epp.prefix.hasher"):
        assert hasher.checked_native(older_xxh3) is None
        assert hasher.checked_native(broken) is None
    assert "disagrees" in caplog.text and "self-test" in caplog.text
    assert hasher.checked_native(hasher._python_chain) is hasher._python_chain
    if NATIVE:  # the loop built here passed it
        assert hasher._native is not None and hasher.checked_native(hasher._native) is not None


def test_an_import_with_a_disagreeing_native_loop_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib
    import sys
    import types

    from epp.prefix import hasher

    fake = types.ModuleType("epp.prefix._chainhash")
    fake.chain_hashes = lambda text, block, seed, start, cap: [0] * ((len(text) - start) // block)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "epp.prefix._chainhash", fake)
    monkeypatch.delenv("EPP_PURE_PYTHON", raising=False)
    try:
        reloaded = importlib.reload(hasher)
        assert reloaded.NATIVE is False
        text = "x" * 640
        assert reloaded.ChunkHasher().hashes(text, 5) == reloaded.ChunkHasher(native=False).hashes(text, 5)
    finally:
        monkeypatch.undo()
        importlib.reload(hasher)
