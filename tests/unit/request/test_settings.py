from __future__ import annotations

import pytest

from epp.errors import ConfigError
from epp.request.settings import ModelTarget, parse_request_control


def test_defaults_and_full_section() -> None:
    assert parse_request_control({}).max_body_bytes == 8 * 1024 * 1024
    rc = parse_request_control(
        {
            "requestControl": {
                "maxBodyBytes": 1000,
                "fallbacks": 2,
                "baseModels": ["base"],
                "modelRewrites": {"a": "b", "c": [{"model": "d", "weight": 3}, {"model": "e"}]},
                "modelPriorities": {"batch": -1},
                "objectives": {"gold": 5},
            }
        }
    )
    assert rc.max_body_bytes == 1000 and rc.fallbacks == 2
    assert rc.model_rewrites["c"] == (ModelTarget("d", 3), ModelTarget("e", 1))
    assert rc.model_priorities["batch"] == -1 and rc.objective_priorities["gold"] == 5


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"maxBodyBytes": "big"}, "requestControl.maxBodyBytes"),
        ({"fallbacks": -1}, "requestControl.fallbacks"),
        ({"modelRewrites": {"c": [{"model": "d", "weight": -2}]}}, "requestControl.modelRewrites.c[0].weight"),
        ({"modelRewrites": {"c": []}}, "requestControl.modelRewrites.c"),
        ({"objectives": {"gold": "high"}}, "requestControl.objectives.gold"),
        ({"typo": 1}, "requestControl.typo"),
    ],
)
def test_errors_name_the_field(section: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_request_control({"requestControl": section})
    assert info.value.field == field
