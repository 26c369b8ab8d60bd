"""``disagg-profile-handler``: prefill/decode disaggregation.

For every request it runs the decode profile (the request is routed to its pick), asks the
decider whether a separate prefill is worth it, and if so runs the prefill profile; the
prefiller it picks goes to the decoder in the ``x-prefiller-host-port`` request header,
where a sidecar (``epp pd-sidecar``, or llm-d's routing sidecar) runs the prefill there and
the decode locally with the KV it produced. Prefix-aware scorers apply to both profiles:
epp's index records the prompt on both endpoints.

Decisions (``epp_pd_decisions_total{decision}``):

* ``split``: prefill on the prefiller, decode on the decoder;
* ``local``: the decider kept it on the decoder (short uncached part, or the prefiller holds
  less of the prompt than the decoder);
* ``no-prefiller``: the decider wanted a split but the prefill profile found no endpoint (none
  with the prefill role is ready): the decoder serves it alone, and a warning is logged;
* ``same-endpoint``: the prefill profile picked the decoder itself (a prefill-decode pod).
* ``decode-only``: no decider configured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from epp.framework.endpoint import Endpoint
from epp.framework.interfaces import PluginContext, RunProfile
from epp.framework.types import CycleState, HandlerResult, ProfileResult

log = logging.getLogger(__name__)

DECISIONS = ("split", "local", "no-prefiller", "same-endpoint", "decode-only")
_WARN_PERIOD_S = 30.0


class Decider(Protocol):
    name: str

    def split(self, state: CycleState, decoder: Endpoint) -> bool: ...

    def confirm(self, state: CycleState, decoder: Endpoint, prefiller: Endpoint) -> bool: ...


def _default_profiles() -> dict[str, str]:
    return {"decode": "decode", "prefill": "prefill"}


@dataclass(slots=True, frozen=True)
class DisaggParams:
    profiles: dict[str, str] = field(default_factory=_default_profiles)
    """Stage -> profile name: ``decode`` (required; the request is routed by it) and
    ``prefill``."""
    deciders: dict[str, str] = field(default_factory=dict)
    """Stage -> decider plugin name: ``prefill`` (without it no request is split)."""

    def check(self, where: str) -> None:
        from epp.errors import ConfigError

        unknown = set(self.profiles) - {"decode", "prefill"}
        if unknown or "decode" not in self.profiles:
            raise ConfigError(f"{where}.profiles", "expected the stages decode and prefill "
                              f"(decode required), got {sorted(self.profiles)}")  # fmt: skip
        if set(self.deciders) - {"prefill"}:
            raise ConfigError(f"{where}.deciders", f"expected only 'prefill', got {sorted(self.deciders)}")
        if "prefill" in self.deciders and "prefill" not in self.profiles:
            raise ConfigError(f"{where}.deciders", "a prefill decider needs a prefill profile")

    def profile_names(self) -> tuple[str, ...]:
        """The profiles the handler runs, the primary (decode) first."""
        names = [self.profiles["decode"]]
        if "prefill" in self.profiles:
            names.append(self.profiles["prefill"])
        return tuple(names)

    def plugin_refs(self) -> tuple[tuple[str, str], ...]:
        return tuple((name, "decider") for name in self.deciders.values())


class DisaggProfileHandler:
    def __init__(self, name: str, params: DisaggParams) -> None:
        self.name = name
        self.params = params
        self._decode = params.profiles["decode"]
        self._prefill = params.profiles.get("prefill", "")
        self.decider: Decider | None = None
        self.decisions: dict[str, int] = dict.fromkeys(DECISIONS, 0)
        self._warned_s = -_WARN_PERIOD_S

    @property
    def profiles(self) -> tuple[str, ...]:
        return self.params.profile_names()

    @property
    def bound(self) -> tuple[object, ...]:
        """The plugins it runs outside the profiles (its decider): the scheduler calls their
        request hooks too, as it does the profiles' plugins'."""
        return () if self.decider is None else (self.decider,)

    def bind(self, plugins: Mapping[str, object]) -> None:
        """Take the decider the parameters name from the built plugins (``epp.wiring``)."""
        name = self.params.deciders.get("prefill")
        if name is not None:
            decider = plugins[name]
            assert hasattr(decider, "split") and hasattr(decider, "confirm"), name
            self.decider = decider  # type: ignore[assignment]

    def handle(
        self, state: CycleState, endpoints: Sequence[Endpoint], run: RunProfile, count: int
    ) -> HandlerResult:
        decode = run(self._decode, endpoints, count)
        if not decode.targets:
            return HandlerResult(decode)
        decoder = decode.targets[0]
        decider = self.decider
        if decider is None or not self._prefill:
            return self._decided(decode, "decode-only")
        if not decider.split(state, decoder):
            return self._decided(decode, "local")
        prefill = run(self._prefill, endpoints, 1)
        if not prefill.targets:
            now = time.monotonic()
            if now - self._warned_s >= _WARN_PERIOD_S:
                self._warned_s = now
                log.warning("%s: request %s should be prefilled apart but no endpoint passed the "
                            "prefill profile %r (no ready prefiller?): the decoder %s serves it "
                            "alone (counted in epp_pd_decisions_total{decision=\"no-prefiller\"})",
                            self.name, state.request.request_id, self._prefill, decoder.id)  # fmt: skip
            return self._decided(decode, "no-prefiller")
        prefiller = prefill.targets[0]
        if prefiller.id == decoder.id:
            return self._decided(decode, "same-endpoint")
        if not decider.confirm(state, decoder, prefiller):
            return self._decided(decode, "local")
        self.decisions["split"] += 1
        return HandlerResult(decode, (prefiller,), "split")

    def _decided(self, decode: ProfileResult, decision: str) -> HandlerResult:
        self.decisions[decision] += 1
        return HandlerResult(decode, (), decision)
    # --- lifecycle: export the decisions --------------------------------------------------

    async def start(self, ctx: PluginContext) -> None:
        ctx.register(_DecisionCollector(self))

    async def stop(self) -> None:
        pass


class _DecisionCollector(Collector):
    def __init__(self, handler: DisaggProfileHandler) -> None:
        self.handler = handler

    def collect(self) -> Iterator[CounterMetricFamily]:
        fam = CounterMetricFamily(
            "epp_pd_decisions", "Prefill/decode decisions of the disaggregation handler.",
            labels=["decision"],
        )  # fmt: skip
        for decision, n in self.handler.decisions.items():
            fam.add_metric([decision], n)
        yield fam
