"""A small real tokenizer directory for tests (no download): a word-level Hugging Face
tokenizer with a chat template, loaded by ``epp.prefix.tokenize`` like any model's."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = ["<s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>", "hello", "world", "how",
         "are", "you", "the", "parcel", "order", "shipping", "desk", "is", "late", "\n"]  # fmt: skip
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tokenizer(directory: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "<|user|>", "<|assistant|>", "<|system|>"])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "add_bos_token": True, "chat_template": TEMPLATE}))  # fmt: skip
    return directory
