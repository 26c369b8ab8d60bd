"""A plugin with background work, added by one registry entry: the server starts it, serves
its metrics, supervises its task and stops it, knowing nothing of it (``Lifecycle``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from epp.framework.endpoint import Endpoint
from epp.framework.interfaces import PluginContext
from epp.framework.types import CycleState
from epp.plugins import registry
from epp.plugins.registry import PluginType
from tests.integration.extproc_fixtures import config_with, start_epp, stop_epp

pytestmark = pytest.mark.asyncio


@dataclass(frozen=True)
class HeartbeatParams:
    fail_first: bool = False
    fail_start: bool = False


class HeartbeatScorer(Collector):
    """Scores every endpoint 1 and counts beats in a loop of its own."""

    started: ClassVar[list[HeartbeatScorer]] = []

    def __init__(self, name: str, params: HeartbeatParams) -> None:
        self.name = name
        self.params = params
        self.beats = 0
        self.runs = 0
        self.stops = 0

    def score(self, state: CycleState, endpoints: Sequence[Endpoint]) -> list[float]:
        return [1.0] * len(endpoints)

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily("test_heartbeats", "Beats of the test plugin.", value=self.beats)

    async def _beat(self) -> None:
        self.runs += 1
        if self.params.fail_first and self.runs == 1:
            raise RuntimeError("first run fails")
        while True:
            self.beats += 1
            await asyncio.sleep(0.01)

    async def start(self, ctx: PluginContext) -> None:
        if self.params.fail_start:
            raise RuntimeError("cannot start")
        ctx.register(self)
        ctx.spawn("heartbeat", self._beat)
        HeartbeatScorer.started.append(self)

    async def stop(self) -> None:
        self.stops += 1


@pytest.fixture(autouse=True)
def heartbeat_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin's registration line (what adding it to epp/plugins/registry.py does)."""
    entry: PluginType[Any] = PluginType(HeartbeatScorer, HeartbeatParams, "scorer", "test")
    monkeypatch.setitem(registry.SCORERS, "heartbeat-scorer", entry)
    monkeypatch.setitem(registry.PLUGIN_TYPES, "heartbeat-scorer", entry)
    HeartbeatScorer.started.clear()


def config(**params: bool) -> Any:
    return config_with({
        "plugins": [{"type": "heartbeat-scorer", "parameters": params},
                    {"type": "max-score-picker"}],
        "schedulingProfiles": [{"name": "p", "plugins": [
            {"pluginRef": "heartbeat-scorer", "weight": 1}, {"pluginRef": "max-score-picker"}]}],
    })  # fmt: skip


def sample(registry_: Any, name: str, **labels: str) -> float | None:
    value: float | None = registry_.get_sample_value(name, labels)
    return value


async def test_the_server_runs_a_plugins_background_work_and_stops_it() -> None:
    epp = await start_epp(config=config(fail_first=True))
    try:
        (plugin,) = HeartbeatScorer.started
        for _ in range(300):
            if plugin.beats > 3:
                break
            await asyncio.sleep(0.01)
        assert plugin.runs == 2  # the failed first run was restarted by the supervisor
        assert plugin.beats > 3
        reg = epp.handle.registry
        assert (sample(reg, "test_heartbeats_total") or 0) > 0  # its collector is on /metrics
        assert sample(reg, "epp_background_task_failures_total", task="heartbeat") == 1
    finally:
        await stop_epp(epp)
    beats = plugin.beats
    await asyncio.sleep(0.05)
    assert plugin.stops == 1 and plugin.beats == beats  # stopped, its task cancelled


async def test_a_plugin_that_cannot_start_fails_the_start_with_its_error() -> None:
    with pytest.raises(RuntimeError, match="cannot start"):
        await start_epp(config=config(fail_start=True))
