"""Emulator settings: one vLLM replica's flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from simulator.model.cost import CostModel


@dataclass(slots=True, frozen=True)
class EmulatorConfig:
    host: str = "127.0.0.1"
    port: int = 0
    """0 picks a free port; the bound URL is on :attr:`RunningEmulator.url`."""
    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    num_gpu_blocks: int = 10240
    """KV blocks the replica holds (vLLM derives it from GPU memory; here it is given).
    10,240 blocks of 16 tokens = 164k tokens, about what Llama-3-8B leaves on a 40 GB GPU."""
    block_size: int = 16
    """Tokens per KV block (vLLM ``--block-size``)."""
    max_num_seqs: int = 32
    max_batched_tokens: int = 8192
    speedup: float = 1.0
    """Divides every modelled duration; latency metrics are reported in modelled seconds."""
    lora_adapters: tuple[str, ...] = ()
    max_loras: int = 4
    max_model_len: int = 32768
    cost: CostModel = field(default_factory=CostModel)
    """Step costs at speedup 1 (``speedup`` above is applied on top)."""
    tokenizer: str = ""
    """A Hugging Face tokenizer directory: prompts are tokenized with it (and its chat
    template) and KV blocks named by vLLM's ``sha256_cbor`` block hashes, as a real server
    does. '' = 4 characters per token and the emulator's own block names."""
    kv_events: str = ""
    """ZMQ endpoint for vLLM-format KV-cache events ('' = off; needs ``tokenizer``): bound
    when it has ``*``, connected to otherwise, as vLLM does."""
    kv_events_topic: str = ""
    """Topic of the events ('' = ``kv@<host>:<port>@<model>``)."""
    kv_events_replay: str = ""
    """ZMQ ROUTER endpoint answering replay requests ('' = none)."""
    kv_store: str = ""
    """A directory of KV shared with other emulators, as vLLM's ``ExampleConnector``
    (``kv_both``) shares it: computed prompts are saved there, and a prompt's leading
    blocks found there are loaded (``kv_transfer_*`` of the cost model) instead of computed.
    Disaggregated prefill runs on it. '' = none."""
    kv_store_max_blocks: int = 1_000_000
    """Most blocks this emulator keeps in the store (its oldest are removed)."""

    def __post_init__(self) -> None:
        checks = {
            "num_gpu_blocks": self.num_gpu_blocks > 0,
            "block_size": self.block_size > 0,
            "max_num_seqs": self.max_num_seqs > 0,
            "max_batched_tokens": self.max_batched_tokens > 0,
            "speedup": self.speedup > 0,
            "max_loras": self.max_loras > 0,
            "max_model_len": self.max_model_len > 0,
            "kv_store_max_blocks": self.kv_store_max_blocks > 0,
            "port": 0 <= self.port <= 65535,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(
                    f"emulator config field {name!r}: bad value {getattr(self, name)!r}"
                )
        if self.kv_events and not self.tokenizer:
            raise ValueError(
                "emulator config field 'kv_events': needs 'tokenizer' (events carry vLLM's "
                "block hashes, which are computed from token ids)"
            )
        if self.model in self.lora_adapters:
            raise ValueError(
                "emulator config field 'lora_adapters': must not repeat the base model"
            )
