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
enough for routing studies.

* **KV transfer** of a disaggregated prefill (prefiller -> decoder): ``kv_transfer_base_s +
  kv_transfer_per_token_s * tokens``. Llama-3-8B's KV is 128 KiB a token (32 layers x 8 KV
  heads x 128 x 2 (K, V) x 2 bytes); over a 200 Gb/s RDMA link (~25 GB/s, NIXL) that is
  ~5 us a token, 10 ms for 2k tokens, plus ~2 ms of set-up and the sidecar's round trip.

* **shared host**: replicas that share one machine's compute (CPU servers on the same cores,
  as the local stack runs them) slow each other down. While a fraction ``f`` of the *other*
  replicas is busy, a step takes ``1 + shared_host_slowdown * f`` times its cost. ``0`` (the
  default): replicas are independent, as on one GPU each. The replay applies it (the
  replicas advance event by event, a decode run re-timed when another replica starts or
  stops); ``epp-sim calibrate`` reads it off servers probed alone and together.

* **step noise**: a real server's steps vary around their cost (other processes, the
  interpreter, the allocator). With ``step_noise`` = s > 0 each step takes its cost times a
  log-normal factor of mean 1 whose logarithm has standard deviation s, so its median is
  ``exp(-s^2 / 2)`` of the cost and its tail longer; a run of ``k`` identical decode steps
  draws one factor of spread ``s / sqrt(k)`` (the spread of their mean). ``0`` (the
  default): every step takes exactly its cost. The engine draws from its own seeded
  generator, so a replay stays repeatable.

* **host stalls**: on a host whose servers share a few cores with everything else, the
  scheduler now and then runs none of them, all at once. ``host_stall_rate_hz`` such stalls
  a second, each of an exponential duration of mean ``host_stall_s``: the replay's replicas
  all stop during one, and a step or a request that meets one waits it out
  (``simulator/model/stalls.py``). ``0`` (the default): none, as on one GPU each. Only the
  replay applies them: the emulator runs on a real host, which stalls on its own.
  ``epp-sim calibrate --from-log --fit-stalls`` fits them to a loaded run.

``speedup`` divides every duration, so a test can run a
"GPU" 100x faster than real time with the same relative timings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any


@dataclass(slots=True, frozen=True)
class CostModel:
    prefill_base_s: float = 0.005
    prefill_per_token_s: float = 0.00009
    prefill_per_cached_token_s: float = 0.000004
    decode_base_s: float = 0.015
    decode_per_seq_s: float = 0.0003
    kv_transfer_base_s: float = 0.002
    kv_transfer_per_token_s: float = 0.000005
    shared_host_slowdown: float = 0.0
    step_noise: float = 0.0
    host_stall_rate_hz: float = 0.0
    host_stall_s: float = 0.0
    speedup: float = 1.0

    def __post_init__(self) -> None:
        for name in (
            "prefill_base_s",
            "prefill_per_token_s",
            "prefill_per_cached_token_s",
            "decode_base_s",
            "decode_per_seq_s",
            "kv_transfer_base_s",
            "kv_transfer_per_token_s",
            "shared_host_slowdown",
            "step_noise",
            "host_stall_rate_hz",
            "host_stall_s",
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

    def kv_transfer_s(self, tokens: int) -> float:
        """Time to move the KV of ``tokens`` prompt tokens from a prefiller to a decoder."""
        return (self.kv_transfer_base_s + self.kv_transfer_per_token_s * tokens) / self.speedup


COST_FIELDS = ("prefill_base_s", "prefill_per_token_s", "prefill_per_cached_token_s", "decode_base_s",
               "decode_per_seq_s", "kv_transfer_base_s", "kv_transfer_per_token_s",
               "shared_host_slowdown", "step_noise", "host_stall_rate_hz", "host_stall_s")  # fmt: skip


@dataclass(slots=True, frozen=True)
class CostProfile:
    """A cost model as data (a preset, or a file ``epp-sim calibrate`` writes): the step
    costs, where they come from, and what the measured server held."""

    name: str
    cost: CostModel
    source: str = ""
    """Where the figures come from (a publication, or the calibration run)."""
    server: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What the measured server reported: ``kv_blocks``, ``block_size``, ``max_num_seqs``..."""


def presets() -> list[str]:
    """The shipped profiles' names (``simulator/model/profiles/*.yaml``)."""
    root = resources.files("simulator.model").joinpath("profiles")
    return sorted(p.name.removesuffix(".yaml") for p in root.iterdir() if p.name.endswith(".yaml"))


def load_profile(spec: str) -> CostProfile:
    """A preset by name, or a profile file (YAML or JSON): ``cost:`` holds the step-cost
    fields (seconds; missing ones keep the default model's), ``name``, ``source`` and
    ``server`` are optional. Errors name the file and field."""
    import yaml

    if spec in presets():
        text = resources.files("simulator.model").joinpath(f"profiles/{spec}.yaml").read_text("utf-8")
        where = f"preset {spec}"
    else:
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"cost profile {spec!r}: no such file, and not a preset "
                             f"({', '.join(presets())})")  # fmt: skip
        text, where = path.read_text(encoding="utf-8"), str(path)
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{where}: not YAML/JSON ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("cost"), dict):
        raise ValueError(f"{where}: expected a mapping with a 'cost' mapping")
    values: dict[str, float] = {}
    for key, value in doc["cost"].items():
        if key not in COST_FIELDS:
            raise ValueError(f"{where}: cost has no field {key!r} (fields: {', '.join(COST_FIELDS)})")
        if isinstance(value, bool) or not isinstance(value, int | float):
            unit = " of seconds" if key.endswith("_s") else ""
            raise ValueError(f"{where}: cost.{key} must be a number{unit}, got {value!r}")
        values[key] = float(value)
    try:
        cost = CostModel(**values)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    server = doc.get("server") or {}
    if not isinstance(server, dict):
        raise ValueError(f"{where}: server must be a mapping")
    return CostProfile(str(doc.get("name") or Path(spec).stem), cost, str(doc.get("source") or ""), server)


def dump_profile(profile: CostProfile) -> str:
    """The profile as YAML (what :func:`load_profile` reads back)."""
    import yaml

    doc = {"name": profile.name, "source": profile.source,
           "cost": {k: getattr(profile.cost, k) for k in COST_FIELDS}, "server": profile.server}  # fmt: skip
    return yaml.safe_dump(doc, sort_keys=False)
