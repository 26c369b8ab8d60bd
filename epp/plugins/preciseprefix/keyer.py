"""Keying a request as a vLLM server will: its tokenizer and chat template, then vLLM's
block hashes (``epp.prefix.tokenize``, ``epp.prefix.blockhash``)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol

from epp.framework.request import ApiKind, InferenceRequest
from epp.plugins.preciseprefix.params import PreciseIndexConfig
from epp.prefix.blockhash import BlockKeys, VllmBlockHasher
from epp.prefix.keycache import PrefixKeyCache
from epp.prefix.tokenize import ModelTokenizer, TokenizerPool
from epp.request.messages import chat_body


class BlockKeyer(Protocol):
    def keys(self, request: InferenceRequest) -> BlockKeys | str:
        """The request's block keys, or the reason it cannot be keyed."""
        ...


def _prompt(tok: ModelTokenizer, api: ApiKind, body: Mapping[str, Any]) -> tuple[str, bool] | list[int] | None:
    """What the server tokenizes (``ModelTokenizer.prompt_text``); Anthropic Messages as the
    chat request vLLM makes of them, vLLM's token-in ``token_ids`` as they are (with media
    ``features``, whose hashes vLLM adds to the blocks, not reproduced)."""
    if api is ApiKind.MESSAGES:
        chat = chat_body(body)
        return None if chat is None else tok.prompt_text(ApiKind.CHAT.value, chat)
    if api is ApiKind.GENERATE:
        ids = body.get("token_ids")
        return list(ids) if isinstance(ids, list) and body.get("features") is None else None
    return tok.prompt_text(api.value, body)


class TokenizingKeyer:
    """Keys a request as a vLLM server will: tokenizer and chat template, then block hashes."""

    def __init__(self, params: PreciseIndexConfig) -> None:
        self.hasher = VllmBlockHasher(params.block_size, params.hash_algo, params.none_hash_seed)
        self.pool = TokenizerPool(params.tokenizers, params.tokenizer_dir)
        self.lora_paths = dict(params.lora_paths)
        self.max_blocks = params.max_blocks
        self.cache = (PrefixKeyCache(self.hasher, params.key_cache_tokens,
                                     params.key_cache_verify_every)
                      if params.key_cache_tokens > 0 else None)  # fmt: skip
        self.seconds = 0.0
        self.count = 0
        self.tokens = 0
        """Tokens of the prompts keyed."""

    def keys(self, request: InferenceRequest) -> BlockKeys | str:
        body = request.body
        if body is None:
            return "no-body"
        # a model with a tokenizer of its own is a base model (a name without
        # requestControl.baseModels reads as an adapter); a configured LoRA is hashed with
        # its name and path, as vLLM does, and tokenized by its base model's tokenizer
        lora: tuple[str, str] | None = None
        tok = None
        path = self.lora_paths.get(request.adapter) if request.adapter else None
        if path is not None:
            lora = (request.adapter, path)
            tok = self.pool.get(self._base_model(request))
        elif request.adapter and not self.pool.named(request.model):
            return "lora-path-unknown"
        else:
            tok = self.pool.get(request.model)
        if tok is None:
            return "no-tokenizer"
        t0 = time.perf_counter()
        prompt = _prompt(tok, request.api, body)
        if prompt is None:
            return "not-reproducible"
        salt = request.cache_salt
        if isinstance(prompt, list):  # token ids: nothing to tokenize
            keys = self.hasher.keys(prompt, cache_salt=salt, lora=lora, max_blocks=self.max_blocks)
        elif self.cache is not None:
            keys = self.cache.keys(tok, *prompt, cache_salt=salt, lora=lora, max_blocks=self.max_blocks)
        else:
            keys = self.hasher.keys(tok.encode(*prompt), cache_salt=salt, lora=lora,
                                    max_blocks=self.max_blocks)  # fmt: skip
        self.seconds += time.perf_counter() - t0
        self.count += 1
        self.tokens += keys.num_tokens
        return keys

    def _base_model(self, request: InferenceRequest) -> str:
        # an adapter's tokenizer is its base model's: the pool's only model, or the adapter's
        # own entry when one is configured
        if request.adapter in self.pool.paths:
            return request.adapter
        return next(iter(self.pool.paths), request.model)
