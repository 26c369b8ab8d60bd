"""Deterministic tokenization approximation and generated text.

The emulator never runs a tokenizer. It assumes **4 characters per token**, the usual rule
of thumb for English text with Llama/GPT tokenizers: a prompt of ``c`` characters is
``ceil(c / 4)`` tokens. Characters, not UTF-8 bytes, are counted, so the rule does not
depend on the script a prompt is written in.

Generated text is exactly 4 characters per token (a 3-letter word and a space), chosen
deterministically from the prompt, so the same prompt always produces the same answer and
a later turn that quotes the answer hits the cached blocks of the earlier one.
"""

from __future__ import annotations

import random

import xxhash

CHARS_PER_TOKEN = 4

_WORDS = (
    "the",
    "and",
    "for",
    "are",
    "but",
    "not",
    "you",
    "all",
    "any",
    "can",
    "had",
    "her",
    "was",
    "one",
    "our",
    "out",
    "day",
    "get",
    "has",
    "him",
    "his",
    "how",
    "man",
    "new",
    "now",
    "old",
    "see",
    "two",
    "way",
    "who",
    "boy",
    "did",
    "its",
    "let",
    "put",
    "say",
    "she",
    "too",
    "use",
    "map",
    "key",
    "set",
    "row",
    "bit",
    "log",
    "run",
    "sum",
    "top",
)


def count_tokens(text: str) -> int:
    """Tokens in ``text`` under the 4-characters-per-token rule (``ceil(len / 4)``)."""
    return -(-len(text) // CHARS_PER_TOKEN)


def token_chars(num_tokens: int) -> int:
    """Characters that ``num_tokens`` generated tokens occupy."""
    return num_tokens * CHARS_PER_TOKEN


def generate_text(prompt: str, num_tokens: int) -> str:
    """The deterministic completion of ``prompt``: ``num_tokens`` tokens of 4 characters.

    Token ``i`` is ``text[4*i : 4*i + 4]``, so a stream can slice it token by token.
    """
    if num_tokens <= 0:
        return ""
    rng = random.Random(xxhash.xxh3_64_intdigest(prompt.encode("utf-8", "surrogatepass")))
    return "".join(word + " " for word in rng.choices(_WORDS, k=num_tokens))


def token_ids_text(token_ids: list[int]) -> str:
    """Pseudo-text for a prompt given as token ids: 4 characters per id (base 36, mod 36**4).

    Keeps the 4-characters-per-token rule, so a prompt of ``n`` ids counts as ``n`` tokens
    and hashes into the same blocks each time it is sent.
    """
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = []
    for tid in token_ids:
        v = tid % 36**4
        out.append(
            digits[v // 46656] + digits[v // 1296 % 36] + digits[v // 36 % 36] + digits[v % 36]
        )
    return "".join(out)
