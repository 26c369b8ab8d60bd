"""The ``precise-prefix-cache-producer`` plugin's name and parameters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from epp.prefix.blockhash import DEFAULT_NONE_HASH_SEED, HashAlgo

PRECISE_PREFIX_PRODUCER = "precise-prefix-cache-producer"
KEYING_S_PER_BODY_BYTE = 1e-6
"""What tokenizing and keying a request costs before it is scheduled, per byte of body: ~2 us
of CPU per token on the whole-prompt rows of docs/results/long_prompts.md (410 ms for 204k
tokens), doubled for a shared host, at ~4 bytes of body per token (a body at the 8 MiB cap:
~8.4 s). What the Envoy in front must wait on top of any queue (``epp.envoyconfig``)."""


@dataclass(slots=True, frozen=True)
class PreciseIndexConfig:
    """Parameters of a ``precise-prefix-cache-producer`` plugin (docs/precise-prefix.md)."""

    block_size: int = 16
    """The servers' ``--block-size`` (vLLM's default is 16)."""
    hash_algo: HashAlgo = "sha256_cbor"
    """The servers' ``--prefix-caching-hash-algo``: ``sha256_cbor`` or vLLM's default ``sha256``."""
    none_hash_seed: str = DEFAULT_NONE_HASH_SEED
    """The servers' ``PYTHONHASHSEED`` when they set one."""
    tokenizers: dict[str, str] = field(default_factory=dict)
    """Model name -> tokenizer directory (``tokenizer.json``, ``tokenizer_config.json``)."""
    tokenizer_dir: str = ""
    """A mounted directory: ``<dir>/<model>/tokenizer.json``, or one model's files at its top."""
    lora_paths: dict[str, str] = field(default_factory=dict)
    """LoRA adapter name -> its path on the servers (part of vLLM's block hash)."""
    max_blocks: int = 0
    """Key at most this many leading blocks of a prompt; 0 keys all of them."""
    key_cache_tokens: int = 16_000_000
    """Prompt tokens whose block keys are kept (about 1.6 bytes a token at block size 16 on
    agent prompts, measured by ``bench/bench_long_prompts.py``), so that a prompt extending a recent one (the
    next turn of a conversation or an agent) is tokenized and hashed only past the known
    part. 0 tokenizes every prompt whole."""
    key_cache_verify_every: int = 1000
    """One in this many prompts keyed from cached pieces is also keyed whole and compared
    (a mismatch turns piecewise keying off for that tokenizer, logged and counted); 0 never."""
    speculative_ttl_seconds: float = 10.0
    """How long a pick counts as held before the server's events confirm it. Long enough
    to cover a request's wait in the server's queue (its blocks are announced when it is
    admitted)."""
    resync_seconds: float = 120.0
    """After an unrepaired gap, the endpoint also uses the approximate index this long."""
    max_entries: int = 8_000_000
    """Global cap on (block, endpoint) entries."""
    mediums: list[str] = field(default_factory=lambda: ["GPU"])
    """Storage tiers whose blocks count as cached (vLLM reports GPU even on CPU servers)."""
    events_mode: Literal["connect", "bind"] = "connect"
    """``connect``: epp subscribes to each endpoint's PUB socket at ``eventsPort`` (servers
    bind ``tcp://*:PORT``; any number of epp replicas may subscribe). ``bind``: epp binds
    ``eventsEndpoint`` and servers connect to it, told apart by their topic."""
    events_port: int = 5557
    """Connect mode: the port of each endpoint's KV-event PUB socket."""
    events_endpoint: str = "tcp://*:5557"
    """Bind mode: the address epp's SUB socket binds."""
    topic_prefix: str = "kv@"
    """Bind mode: a topic ``<prefix><ip>:<port>@<model>`` names the endpoint ``ip:port``."""
    replay_port: int = 0
    """Each server's ``replay_endpoint`` port (a ROUTER socket); 0: no replay, gaps resync."""
    replay_timeout_seconds: float = 1.0
    """How long a replay request may take before the endpoint resyncs instead."""
    queue_batches: int = 4096
    """Event batches waiting to be applied; beyond it the oldest are dropped (a gap)."""
    approximate_fallback: bool = True
    """Run the approximate producer too (added before this one when the config has none):
    it scores servers without events and those resyncing."""
