"""P/D deciders: whether a request's prefill is worth running on a separate prefiller.

The handler asks ``split(state, decoder)`` once the decode profile has picked; if yes and a
prefiller is found, ``confirm(state, decoder, prefiller)`` may still keep the request local
(the deciders that look only at the decoder confirm every split).

* ``always-disagg-pd-decider``: every request is split;
* ``never-disagg-pd-decider``: never (a P/D pool serving aggregated, for comparison);
* ``prefix-based-pd-decider``: split when the prompt's tokens the decoder does not hold
  exceed ``nonCachedTokens`` (llm-d's decider of the same name; 0 never splits);
* ``cache-aware-pd-decider``: as ``prefix-based``, and only when the prefiller holds at least
  as much of the prompt as the decoder (give or take ``slackTokens``): a split that made the
  prefiller recompute what the decoder already caches would add work, not move it.

Token counts come from the prefix match (``CycleState.prefix``: chunks of ``block_chars``
characters) and the prompt's length, read at ``charsPerToken``.
"""

from __future__ import annotations

from dataclasses import dataclass

from epp.framework.endpoint import Endpoint
from epp.framework.types import CycleState


def uncached_tokens(state: CycleState, endpoint: Endpoint, chars_per_token: float) -> float:
    """The prompt's tokens ``endpoint`` does not hold, by the prefix match."""
    prefix = state.prefix
    matched_chars = prefix.matched.get(endpoint.id, 0) * prefix.block_chars
    return max(0.0, len(state.request.prompt) - matched_chars) / chars_per_token


@dataclass(slots=True, frozen=True)
class NoDeciderParams:
    pass


class AlwaysDecider:
    def __init__(self, name: str, params: NoDeciderParams) -> None:
        self.name = name

    def split(self, state: CycleState, decoder: Endpoint) -> bool:
        return True

    def confirm(self, state: CycleState, decoder: Endpoint, prefiller: Endpoint) -> bool:
        return True


class NeverDecider(AlwaysDecider):
    def split(self, state: CycleState, decoder: Endpoint) -> bool:
        return False


@dataclass(slots=True, frozen=True)
class PrefixDeciderParams:
    non_cached_tokens: int = 256
    """Split when the decoder lacks more than this many of the prompt's tokens (0: never)."""
    chars_per_token: float = 4.0
    """To read prompt lengths and prefix matches (characters) as tokens."""

    def check(self, where: str) -> None:
        from epp.errors import ConfigError

        if self.chars_per_token <= 0:
            raise ConfigError(f"{where}.charsPerToken", "must be positive")


class PrefixBasedDecider:
    def __init__(self, name: str, params: PrefixDeciderParams) -> None:
        self.name = name
        self.params = params

    def split(self, state: CycleState, decoder: Endpoint) -> bool:
        p = self.params
        if p.non_cached_tokens <= 0:
            return False
        return uncached_tokens(state, decoder, p.chars_per_token) > p.non_cached_tokens

    def confirm(self, state: CycleState, decoder: Endpoint, prefiller: Endpoint) -> bool:
        return True


@dataclass(slots=True, frozen=True)
class CacheAwareDeciderParams(PrefixDeciderParams):
    slack_tokens: int = 0
    """Split when the prefiller lacks at most this many tokens more than the decoder."""


class CacheAwareDecider(PrefixBasedDecider):
    params: CacheAwareDeciderParams

    def __init__(self, name: str, params: CacheAwareDeciderParams) -> None:
        super().__init__(name, params)
        self.params = params

    def confirm(self, state: CycleState, decoder: Endpoint, prefiller: Endpoint) -> bool:
        p = self.params
        at_decoder = uncached_tokens(state, decoder, p.chars_per_token)
        at_prefiller = uncached_tokens(state, prefiller, p.chars_per_token)
        return at_prefiller <= at_decoder + p.slack_tokens
