"""docs/plugins.md's worked example is real code: this runs the very block the guide shows,
registered as the guide says, through the config loader and the server's lifecycle."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from epp.config.loader import loads_config
from epp.errors import ConfigError
from epp.framework.endpoint import Endpoint
from epp.framework.interfaces import PluginContext
from epp.plugins import registry
from epp.plugins.registry import PluginType
from epp.wiring import build_scheduler

ROOT = Path(__file__).resolve().parents[3]
GUIDE = (ROOT / "docs" / "plugins.md").read_text()


def example() -> types.ModuleType:
    section = GUIDE.split("## Worked example", 1)[1]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    module = types.ModuleType("endpoint_weights_example")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(code, "docs/plugins.md", "exec"), module.__dict__)
    return module


@pytest.fixture
def plugin(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    mod = example()
    entry: PluginType[Any] = PluginType(
        mod.EndpointWeightsScorer, mod.EndpointWeightsParams, "scorer", "example"
    )
    monkeypatch.setitem(registry.SCORERS, "endpoint-weights-scorer", entry)
    monkeypatch.setitem(registry.PLUGIN_TYPES, "endpoint-weights-scorer", entry)
    return mod


def guide_yaml(path: Path) -> str:
    text = re.findall(r"```yaml\n(.*?)```", GUIDE.split("## Worked example", 1)[1], re.S)[0]
    return text.replace("/etc/epp/weights.json", str(path))


def test_the_guides_plugin_loads_starts_scores_and_reloads(
    plugin: types.ModuleType, tmp_path: Path
) -> None:
    weights = tmp_path / "weights.json"
    weights.write_text(json.dumps({"10.0.0.1:8000": 4, "10.0.0.2:8000": 1}))
    cfg = loads_config(guide_yaml(weights))
    sched = build_scheduler(cfg)
    scorer = sched.plugin(plugin.EndpointWeightsScorer)
    assert scorer is not None and scorer in sched.lifecycle

    async def run() -> list[float]:
        spawned: list[asyncio.Task[None]] = []
        registered: list[object] = []
        ctx = PluginContext(
            spawn=lambda kind, loop: spawned.append(asyncio.ensure_future(loop())) or spawned[-1],
            register=registered.append, on_failure=lambda kind: None,
        )
        await scorer.start(ctx)
        assert registered == [scorer] and len(spawned) == 1
        eps = [Endpoint(f"10.0.0.{i}:8000", f"10.0.0.{i}", 8000) for i in (1, 2, 3)]
        scores = list(scorer.score(None, eps))
        spawned[0].cancel()
        await scorer.stop()
        return scores

    assert asyncio.run(run()) == [1.0, 0.25, 0.25]  # 10.0.0.3 takes defaultWeight 1


def test_the_guides_plugin_names_a_bad_parameter(plugin: types.ModuleType) -> None:
    with pytest.raises(ConfigError) as err:
        loads_config(guide_yaml(Path("/x")).replace("reloadSeconds: 5", "reloadSeconds: 0"))
    assert err.value.field == "plugins[2].parameters.reloadSeconds"
