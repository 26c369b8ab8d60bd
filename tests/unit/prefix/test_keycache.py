"""The precise producer's key cache: a prompt keyed from cached pieces has exactly the keys
of the whole prompt tokenized and hashed afresh, for every way the cache is reached
(growing conversations, branches, salts, adapters, block limits, eviction, threads), and a
tokenizer that cannot be cut is keyed whole."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from typing import Any

import pytest

from epp.prefix.blockhash import VllmBlockHasher
from epp.prefix.keycache import PrefixKeyCache
from epp.prefix.tokenize import ModelTokenizer
from tests.wordlevel import write_tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = ("the", "parcel", "order", "shipping", "desk", "is", "late", "tool", "result", "json",
         "error", "file", "line", "def", "return", "12", "3.5", "(", ")", "{", "}", ":", ";", "中文",
         "émigré", "", "naïve")


def text(rng: random.Random, n: int) -> str:
    seps = [" ", " ", " ", "\n", "\n\n", "  ", "\t"]
    return "".join(rng.choice(WORDS) + rng.choice(seps) for _ in range(n))


def bpe_dir(directory: Path, *, metaspace_first: bool = False) -> Path:
    """A byte-level BPE (the GPT/Qwen/DeepSeek family) trained on the spot, with a ChatML
    template; or a Metaspace one that marks only the first word (Llama-2 style)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token=None if not metaspace_first else "<unk>"))
    if metaspace_first:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
        specials.append("<unk>")
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    rng = random.Random(7)
    tok.train_from_iterator([text(rng, 50) for _ in range(300)], trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHATML}))  # fmt: skip
    return directory


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> ModelTokenizer:
    return ModelTokenizer(bpe_dir(tmp_path_factory.mktemp("bpe")))


def whole(hasher: VllmBlockHasher, tok: ModelTokenizer, prompt: str, special: bool = False,
          **kw: Any) -> tuple[list[int], int]:  # fmt: skip
    keys = hasher.keys(tok.encode(prompt, special), **kw)
    return keys.keys, keys.num_tokens


def conversation(rng: random.Random, turns: int, system: str) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for _ in range(turns):
        msgs.append({"role": "user", "content": text(rng, rng.randint(1, 40))})
        msgs.append({"role": "assistant", "content": text(rng, rng.randint(0, 30))})
    return msgs


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_growing_and_branching_conversations_key_as_whole(bpe: ModelTokenizer, block_size: int) -> None:
    assert bpe.segments("a<|im_start|>b<|im_end|>", False) == ["a", "<|im_start|>b", "<|im_end|>"]
    hasher = VllmBlockHasher(block_size)
    cache = PrefixKeyCache(hasher, verify_every=0)
    rng = random.Random(block_size)
    system = text(rng, 200)
    parents = [conversation(rng, 3, system) for _ in range(3)]
    for step in range(40):
        msgs = rng.choice(parents)
        if rng.random() < 0.3:  # a sub-agent: a branch under a parent's context
            msgs = [*msgs, {"role": "user", "content": text(rng, 10)}]
        else:
            msgs.append({"role": "user", "content": text(rng, rng.randint(1, 60))})
        body = {"messages": msgs, "add_generation_prompt": step % 2 == 0}
        prompt = bpe.render_chat(body)
        assert prompt is not None
        got = cache.keys(bpe, prompt, False)
        assert (got.keys, got.num_tokens) == whole(hasher, bpe, prompt)
        if step % 3 == 0:
            msgs.append({"role": "assistant", "content": text(rng, 20)})
    assert cache.stats.tokens_reused > 5 * cache.stats.tokens_encoded  # the point of it


def test_salts_adapters_and_special_tokens_are_separate_chains(bpe: ModelTokenizer) -> None:
    hasher = VllmBlockHasher(4)
    cache = PrefixKeyCache(hasher, verify_every=0)
    rng = random.Random(3)
    prompt = bpe.render_chat({"messages": conversation(rng, 4, text(rng, 50))})
    assert prompt is not None
    variants: list[dict[str, Any]] = [{}, {"cache_salt": "tenant-a"}, {"lora": ("ad", "/a")},
                                      {"cache_salt": "s", "lora": ("ad", "/a")}]  # fmt: skip
    seen = set()
    for _ in range(2):  # the second round is served from the cache
        for kw in variants:
            for special in (False, True):
                got = cache.keys(bpe, prompt, special, **kw)
                assert (got.keys, got.num_tokens) == whole(hasher, bpe, prompt, special, **kw)
                seen.add(tuple(got.keys[:2]))
    assert len(seen) == 4  # the special flag adds nothing for this tokenizer; salts and adapters do


def test_word_level_tokenizer_with_bos_and_a_block_limit(tmp_path: Path) -> None:
    tok = ModelTokenizer(write_tokenizer(tmp_path / "wl"))
    hasher = VllmBlockHasher(2)
    cache = PrefixKeyCache(hasher, verify_every=0)
    msgs = [{"role": "user", "content": "hello world how are you"}]
    for _ in range(5):
        prompt = tok.render_chat({"messages": msgs})
        assert prompt is not None
        for special in (False, True):  # add_bos_token: BOS only on the prompt's first piece
            got = cache.keys(tok, prompt, special)
            assert (got.keys, got.num_tokens) == whole(hasher, tok, prompt, special)
            cut = cache.keys(tok, prompt, special, max_blocks=3)
            assert cut.keys == got.keys[:3]
        msgs += [{"role": "assistant", "content": "the parcel is late"},
                 {"role": "user", "content": "the order"}]  # fmt: skip


def test_a_tokenizer_marking_only_the_first_word_is_keyed_whole(tmp_path: Path) -> None:
    tok = ModelTokenizer(bpe_dir(tmp_path / "meta", metaspace_first=True))
    prompt = "hello there<|im_start|>user\nhow<|im_end|>"
    assert tok.segments(prompt, False) == [prompt]
    hasher = VllmBlockHasher(2)
    got = PrefixKeyCache(hasher).keys(tok, prompt, False)
    assert (got.keys, got.num_tokens) == whole(hasher, tok, prompt)


def test_a_wrong_cut_is_caught_by_verification_and_the_tokenizer_keyed_whole(
    bpe: ModelTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tok = ModelTokenizer(bpe.directory)
    # cut inside words: piecewise ids differ from the whole prompt's
    monkeypatch.setattr(tok, "segments", lambda t, s: [t[i : i + 7] for i in range(0, len(t), 7)])
    hasher = VllmBlockHasher(2)
    cache = PrefixKeyCache(hasher, verify_every=2)
    prompt = "the parcel order shipping desk is late, the parcel order is late"
    first = cache.keys(tok, prompt, False)
    assert first.keys != whole(hasher, tok, prompt)[0]  # what verification is for
    second = cache.keys(tok, prompt, False)  # verified: wrong, so answered whole
    assert (second.keys, second.num_tokens) == whole(hasher, tok, prompt)
    assert cache.stats.mismatches == 1 and cache.nodes == 0
    assert "keyed whole" in caplog.text
    monkeypatch.undo()
    assert tok.segments(prompt + "<|im_end|>x", False) == [prompt + "<|im_end|>x"]  # cuts off


def test_memory_is_bounded_and_eviction_keeps_keys_right(bpe: ModelTokenizer) -> None:
    hasher = VllmBlockHasher(4)
    cache = PrefixKeyCache(hasher, max_tokens=3_000, verify_every=0)
    rng = random.Random(5)
    for i in range(60):
        msgs = conversation(rng, rng.randint(1, 6), f"system {i % 7} " + text(rng, 40))
        prompt = bpe.render_chat({"messages": msgs})
        assert prompt is not None
        got = cache.keys(bpe, prompt, False)
        assert (got.keys, got.num_tokens) == whole(hasher, bpe, prompt)
        assert cache.size <= 3_000
    assert cache.stats.evicted_nodes > 0


def test_threads_keying_overlapping_prompts_get_right_keys(bpe: ModelTokenizer) -> None:
    hasher = VllmBlockHasher(4)
    cache = PrefixKeyCache(hasher, max_tokens=20_000, verify_every=0)
    rng = random.Random(9)
    base = conversation(rng, 4, text(rng, 100))
    prompts = []
    for i in range(40):
        msgs = [*base[: 1 + i % 8], {"role": "user", "content": text(rng, 20)}]
        prompt = bpe.render_chat({"messages": msgs})
        assert prompt is not None
        prompts.append((prompt, whole(hasher, bpe, prompt)))
    errors: list[str] = []

    def work(seed: int) -> None:
        r = random.Random(seed)
        for _ in range(60):
            prompt, want = r.choice(prompts)
            got = cache.keys(bpe, prompt, False)
            if (got.keys, got.num_tokens) != want:
                errors.append(prompt[:40])

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
