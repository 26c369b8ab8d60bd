"""Step-time cost model of one replica (a 7-8B model on one A100-class GPU by default).

Two linear laws, fitted by eye to published vLLM figures for Llama-3-8B on an A100-80GB:

* **prefill** of one request: ``prefill_base_s + prefill_per_token_s * uncached_tokens +
  prefill_per_cached_token_s * cached_tokens``. Computing KV for new tokens dominates
  (~11k tokens/s); cached tokens cost only the attention reads over them. Defaults give
  ~190 ms for an uncached 2k-token prompt and ~13 ms for a fully cached one, i.e. a TTFT of
  ~205 ms and ~28 ms once the decode step that emits the first token is added.
* **decode step** (every running request advances one token): ``decode_base_s +
  decode_per_seq_s * batch_size``: ~15 ms of weight reads plus ~0.3 ms per sequence, so a
  lone request streams ~65 tokens/s and a batch of 32 ~1,300 tokens/s.

The cost of one engine step that admits new requests is the sum of their prefills plus one
decode step over the whole batch (prefill and decode share the step, as in vLLM's mixed
batches). Attention's quadratic term is ignored: a 15k-token prompt costs 1.4 s, close
enough for routing studies. ``speedup`` divides every duration, so a test can run a
"GPU" 100x faster than real time with the same relative timings.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class CostModel:
    prefill_base_s: float = 0.005
    prefill_per_token_s: float = 0.00009
    prefill_per_cached_token_s: float = 0.000004
    decode_base_s: float = 0.015
    decode_per_seq_s: float = 0.0003
    speedup: float = 1.0

    def __post_init__(self) -> None:
        for name in (
            "prefill_base_s",
            "prefill_per_token_s",
            "prefill_per_cached_token_s",
            "decode_base_s",
            "decode_per_seq_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"cost model field {name!r} must be >= 0")
        if self.speedup <= 0:
            raise ValueError(f"cost model field 'speedup' must be > 0, got {self.speedup}")

    def prefill_s(self, uncached_tokens: int, cached_tokens: int = 0) -> float:
        """Time to compute the KV of one prompt of which ``cached_tokens`` were cache hits."""
        return (
            self.prefill_base_s
            + self.prefill_per_token_s * uncached_tokens
            + self.prefill_per_cached_token_s * cached_tokens
        ) / self.speedup

    def decode_step_s(self, batch_size: int) -> float:
        """One decode step in which ``batch_size`` running requests each emit one token."""
        return (self.decode_base_s + self.decode_per_seq_s * batch_size) / self.speedup
