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
* ``load-aware-pd-decider``: as ``prefix-based``, and only when the prefill would start no
  later on the prefiller than on the decoder: the prompt tokens waiting for their first token
  on the prefiller plus what it lacks of this prompt, against the same on the decoder, with
  ``slackTokens`` in the prefiller's favour (a prefill kept on the decoder also stalls its
  decodes). Prefillers that fall behind stop taking work until they catch up, so a pool
  with too few of them degrades to serving locally instead of queueing behind them
  (NVIDIA Dynamo's conditional disaggregation weighs its prefill queue the same way). The
  waiting tokens are epp's one accounting of the prefill it sent and has not seen done
  (``CycleState.prefill``: added at the pick where the prefill runs, the prefiller of a
  split request, released at the first token or the end; with index sync the other
  replicas' too), read at ``charsPerToken``.

Token counts come from the prefix match (``CycleState.prefix``: chunks of ``block_chars``
characters) and the prompt's length, read at ``charsPerToken``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

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


@dataclass(slots=True, frozen=True)
class LoadAwareDeciderParams(PrefixDeciderParams):
    slack_tokens: int = 32768
    """Split while the prefiller's waiting prompt tokens (with what it lacks of this one)
    exceed the decoder's by at most this many: ~3 s of prefill for an 8B model on an A100,
    the wait a split may add to spare the decoder's running requests a prefill (4,096 kept
    too much on the decoders when prefillers were plentiful: docs/results/pd.md)."""
    __config_min__: ClassVar[dict[str, float]] = {"slack_tokens": 0}


class LoadAwareDecider(PrefixBasedDecider):
    params: LoadAwareDeciderParams

    def __init__(self, name: str, params: LoadAwareDeciderParams) -> None:
        super().__init__(name, params)
        self.params = params

    def confirm(self, state: CycleState, decoder: Endpoint, prefiller: Endpoint) -> bool:
        p = self.params
        at_decoder = uncached_tokens(state, decoder, p.chars_per_token)
        at_prefiller = uncached_tokens(state, prefiller, p.chars_per_token)
        waiting = state.prefill
        there = waiting.get(prefiller.id, 0.0) / p.chars_per_token + at_prefiller
        here = waiting.get(decoder.id, 0.0) / p.chars_per_token + at_decoder
        return there <= here + p.slack_tokens
