"""Read the few metric families epp needs from a Prometheus text page, as bytes.

The page is never decoded or tokenized as a whole: for each family the parser searches the
bytes for ``\\n<name>`` and reads only those lines, so a real vLLM page (56 KB, ~690 lines,
mostly histograms) costs a handful of ``bytes.find`` calls. The info lines (cache config,
LoRA state) rarely change: a :class:`PageParser` keeps one per endpoint and re-reads their
labels only when the line's bytes differ from the previous scrape.

A model server's page is untrusted input. What happens to odd values, in one place:

* a sample value that is not a finite number (NaN, +Inf, -Inf, garbage, more than
  ``MAX_NUMBER_CHARS`` characters) is rejected: that series is skipped;
* a negative count or usage is clamped to 0, a count above ``MAX_COUNT`` to ``MAX_COUNT``,
  KV usage above 1 to 1;
* integer label values (``max_lora``, ``block_size``, ``num_gpu_blocks``) count only when they
  are ASCII digits (``"²"`` is not) of at most 12 characters; else they read as unknown (0);
* bytes that are not UTF-8 in label values are replaced, never raised on.

Each rejection or clamp is reported to the ``on_reject(family, reason)`` hook (a counter in
``epp serve``). A page with none of the engine's load metrics raises
``ScrapeError("missing_metrics")``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote

from epp.framework.endpoint import Metrics

MAX_NUMBER_CHARS = 40
MAX_COUNT = 1_000_000
MAX_INT_LABEL_DIGITS = 12

RejectHook = Callable[[str, str], None]
"""``(family, reason)``; reasons: ``not_a_number``, ``not_finite``, ``negative``, ``too_large``."""


class ScrapeError(Exception):
    """A scrape that stored nothing; ``reason`` is a bounded label value for the counter."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(slots=True, frozen=True)
class MetricNames:
    waiting: tuple[str, ...]
    running: tuple[str, ...]
    kv_usage: tuple[str, ...]
    """Alternatives, first present wins (vLLM renamed gpu_cache_usage_perc in v0.10)."""
    lora_info: str = ""
    cache_config: str = ""
    kv_capacity_tokens: str = ""
    """Engines that report KV capacity in tokens rather than blocks (SGLang)."""
    started: str = "process_start_time_seconds"
    """The process start time (Prometheus' client writes it): a new value, a new server."""
    lifetime: tuple[str, ...] = ()
    """Counters (sample names) that only grow while the server lives: summed, a smaller sum
    means it restarted."""
    sleep_state: str = ""
    """vLLM's ``engine_sleep_state`` gauge (one series per ``sleep_state``: ``awake`` 0, or
    ``weights_offloaded`` / ``discard_all`` 1, means asleep)."""


VLLM = MetricNames(
    waiting=("vllm:num_requests_waiting",),
    running=("vllm:num_requests_running",),
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    lora_info="vllm:lora_requests_info",
    cache_config="vllm:cache_config_info",
    lifetime=("vllm:prefix_cache_queries_total",),
    sleep_state="vllm:engine_sleep_state",
)
SGLANG = MetricNames(
    waiting=("sglang:num_queue_reqs",),
    running=("sglang:num_running_reqs",),
    kv_usage=("sglang:token_usage",),
    kv_capacity_tokens="sglang:max_total_num_tokens",
)
ENGINES: dict[str, MetricNames] = {"vllm": VLLM, "sglang": SGLANG}


def query_for(names: MetricNames) -> str:
    """``?name[]=...`` for the families epp reads. Prometheus' Python client (which serves
    vLLM's and SGLang's pages) then renders only those: vLLM's 56 KB page becomes ~2 KB and
    the server collects only those metrics. Servers that ignore the query send it all."""
    wanted = [*names.waiting, *names.running, *names.kv_usage, names.lora_info,
              names.cache_config, names.kv_capacity_tokens, names.started, *names.lifetime,
              names.sleep_state]  # fmt: skip
    return "?" + "&".join(f"name%5B%5D={quote(n, safe='')}" for n in wanted if n)

_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(slots=True, frozen=True)
class Sample:
    labels: bytes
    value: float


def _ignore(family: str, reason: str) -> None:
    pass


def sample_lines(page: bytes, name: bytes) -> list[tuple[bytes, bytes]]:
    """``(labels, value token)`` of the sample lines of metric ``name`` (exact name: not a
    prefix of a longer one, not in a comment).

    The text format keeps all lines of a metric in one group, so the scan stops at the first
    line after the group: one ``find`` locates a family, however long the page.
    """
    out: list[tuple[bytes, bytes]] = []
    skip = len(name)
    if page.startswith(name) and page[skip : skip + 1] in _AFTER_NAME:
        start = 0
    else:
        needle = b"\n" + name
        pos = page.find(needle)
        while pos >= 0 and page[pos + 1 + skip : pos + 2 + skip] not in _AFTER_NAME:
            pos = page.find(needle, pos + 1)  # a longer name that starts with this one
        if pos < 0:
            return out
        start = pos + 1
    size = len(page)
    while start < size:
        end = page.find(b"\n", start)
        if end < 0:
            end = size
        if not page.startswith(name, start, end):
            break
        line = page[start + skip : end]
        first = line[:1]
        if first == b"{":
            close = line.rfind(b"}")
            if close > 0:
                parts = line[close + 1 :].split()
                if parts:
                    out.append((line[1:close], parts[0]))
        elif first in (b" ", b"\t"):
            parts = line.split()
            if parts:
                out.append((b"", parts[0]))
        else:  # a longer name: this family's group has ended
            break
        start = end + 1
    return out


_AFTER_NAME = (b"{", b" ", b"\t")


def read_number(token: bytes) -> float | None:
    """A finite float, or None for anything else (NaN, infinities, overlong, garbage)."""
    if len(token) > MAX_NUMBER_CHARS:
        return None
    try:
        value = float(token)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def read_int_label(text: str) -> int:
    """An integer label value: ASCII digits only, bounded length; else 0 (unknown)."""
    if text.isascii() and text.isdigit() and len(text) <= MAX_INT_LABEL_DIGITS:
        return int(text)
    return 0


def parse_labels(raw: bytes) -> dict[str, str]:
    text = raw.decode("utf-8", "replace")
    return {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(text)}


def _adapters(value: str) -> frozenset[str]:
    return frozenset(a.strip() for a in value.split(",") if a.strip())


class PageParser:
    """Parses one endpoint's pages; remembers its info lines between scrapes."""

    __slots__ = ("_cc", "_cc_line", "_encoded", "_lora", "_lora_line", "_models", "_models_key", "_names",
                 "_on_reject")  # fmt: skip

    def __init__(self, names: MetricNames, on_reject: RejectHook | None = None) -> None:
        self._names = names
        self._encoded = {
            n: n.encode()
            for n in (*names.waiting, *names.running, *names.kv_usage, names.lora_info,
                      names.cache_config, names.kv_capacity_tokens, names.started,
                      *names.lifetime, names.sleep_state)
            if n
        }  # fmt: skip
        self._on_reject = on_reject or _ignore
        self._lora_line: bytes | None = None
        self._lora: tuple[frozenset[str], frozenset[str], int] = (frozenset(), frozenset(), 0)
        self._cc_line: bytes | None = None
        self._cc: tuple[int, int] = (0, 0)
        self._models_key: tuple[bytes, ...] = ()
        self._models: frozenset[str] = frozenset()

    def _values(self, page: bytes, family: str) -> list[Sample]:
        samples: list[Sample] = []
        for labels, token in sample_lines(page, self._encoded[family]):
            value = read_number(token)
            if value is None:
                reason = "not_finite" if token.lower().lstrip(b"+-") in (b"nan", b"inf") else (
                    "not_a_number"
                )
                self._on_reject(family, reason)
                continue
            samples.append(Sample(labels, value))
        return samples

    def _first_family(self, page: bytes, families: tuple[str, ...]) -> tuple[str, list[Sample]]:
        for family in families:
            samples = self._values(page, family)
            if samples:
                return family, samples
        return "", []

    def _count(self, family: str, samples: list[Sample]) -> int | None:
        """Several series (data-parallel ranks, model names) add up; clamped to [0, MAX]."""
        if not samples:
            return None
        total = 0.0
        for s in samples:
            if s.value < 0:
                self._on_reject(family, "negative")
            else:
                total += s.value
        if total > MAX_COUNT:
            self._on_reject(family, "too_large")
            total = MAX_COUNT
        return int(total)

    def parse(self, page: bytes, now_s: float) -> Metrics:
        names = self._names
        waiting = self._count(*self._first_family(page, names.waiting))
        running_family, running_samples = self._first_family(page, names.running)
        running = self._count(running_family, running_samples)
        kv_family, kv_samples = self._first_family(page, names.kv_usage)
        kv: float | None = None
        if kv_samples:
            kv = max(s.value for s in kv_samples)  # ranks: the fullest one
            if kv < 0:
                self._on_reject(kv_family, "negative")
            elif kv > 1:
                self._on_reject(kv_family, "too_large")
        if waiting is None and running is None and kv is None:
            raise ScrapeError("missing_metrics", "none of the engine's load metrics present")

        running_adapters, waiting_adapters, max_adapters = self._lora_state(page)
        block_size, gpu_blocks = self._cache_config(page)
        if names.kv_capacity_tokens:
            cap = self._values(page, names.kv_capacity_tokens)
            if cap:
                tokens = max(s.value for s in cap)
                block_size, gpu_blocks = 1, int(min(max(tokens, 0.0), 2.0**40))
        return Metrics(
            waiting=waiting or 0,
            running=running or 0,
            kv_usage=min(1.0, max(0.0, kv or 0.0)),
            running_adapters=running_adapters,
            waiting_adapters=waiting_adapters,
            max_adapters=max_adapters,
            block_size_tokens=block_size,
            num_gpu_blocks=gpu_blocks,
            scraped_at_s=now_s,
            served_models=self._served_models(running_samples),
            started_s=self._started(page),
            lifetime_total=self._lifetime(page),
            not_serving="asleep" if self._asleep(page) else "",
        )

    def _started(self, page: bytes) -> float:
        if not self._names.started:
            return 0.0
        samples = self._values(page, self._names.started)
        return samples[0].value if samples and samples[0].value > 0 else 0.0

    def _lifetime(self, page: bytes) -> float:
        """The lifetime counters' sum (-1: none on the page)."""
        total, seen = 0.0, False
        for family in self._names.lifetime:
            for s in self._values(page, family):
                if s.value >= 0:
                    total, seen = total + s.value, True
        return total if seen else -1.0

    def _asleep(self, page: bytes) -> bool:
        """Any engine of the server reports it is not awake (vLLM's sleep mode)."""
        if not self._names.sleep_state:
            return False
        for s in self._values(page, self._names.sleep_state):
            if b'sleep_state="awake"' in s.labels:
                if s.value == 0:
                    return True
            elif s.value == 1:  # weights_offloaded, discard_all
                return True
        return False

    def _served_models(self, samples: list[Sample]) -> frozenset[str]:
        """The ``model_name`` labels of the running gauge's series (parsed once per set)."""
        key = tuple(s.labels for s in samples[:8])  # data-parallel ranks: a few series
        if key != self._models_key:
            self._models_key = key
            self._models = frozenset(m for raw in key if (m := parse_labels(raw).get("model_name", ""))
                                     and len(m) <= 256)  # fmt: skip
        return self._models

    def _lora_state(self, page: bytes) -> tuple[frozenset[str], frozenset[str], int]:
        if not self._names.lora_info:
            return self._lora
        samples = self._values(page, self._names.lora_info)
        if not samples:
            self._lora_line, self._lora = None, (frozenset(), frozenset(), 0)
            return self._lora
        # one series per state change; the value is its timestamp: the newest wins
        latest = max(samples, key=lambda s: s.value).labels
        if latest != self._lora_line:
            labels = parse_labels(latest)
            self._lora_line = latest
            self._lora = (
                _adapters(labels.get("running_lora_adapters", "")),
                _adapters(labels.get("waiting_lora_adapters", "")),
                read_int_label(labels.get("max_lora", "")),
            )
        return self._lora

    def _cache_config(self, page: bytes) -> tuple[int, int]:
        if not self._names.cache_config:
            return self._cc
        lines = sample_lines(page, self._encoded[self._names.cache_config])
        if not lines:
            self._cc_line, self._cc = None, (0, 0)
            return self._cc
        raw = lines[0][0]
        if raw != self._cc_line:
            labels = parse_labels(raw)
            self._cc_line = raw
            self._cc = (
                read_int_label(labels.get("block_size", "")),
                read_int_label(labels.get("num_gpu_blocks", "")),
            )
        return self._cc


def parse_metrics(page: bytes | str, names: MetricNames, now_s: float) -> Metrics:
    """One page, no memory of earlier ones (tests, the emulator's checks)."""
    data = page.encode() if isinstance(page, str) else page
    return PageParser(names).parse(data, now_s)
