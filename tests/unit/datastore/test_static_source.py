from __future__ import annotations

import pytest

from epp.datastore.static import StaticSource, endpoints_from_config, parse_endpoint_list
from epp.datastore.store import Datastore
from epp.errors import ConfigError
from epp.framework.endpoint import ENGINE_LABEL


def test_flag_list() -> None:
    eps = parse_endpoint_list("10.0.0.1:8000, 10.0.0.2:8001,[fd00::1]:9000", engine="sglang")
    assert [e.id for e in eps] == ["10.0.0.1:8000", "10.0.0.2:8001", "[fd00::1]:9000"]
    assert eps[0].engine == "sglang"
    ds = Datastore()
    StaticSource(eps).start(ds)
    assert ds.synced and len(ds) == 3


@pytest.mark.parametrize(("text", "field"), [("10.0.0.1", "--endpoints[0]"), ("a:1,b:99999", "--endpoints[1]"), ("a:1,a:1", "--endpoints")])
def test_flag_errors_name_the_entry(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_endpoint_list(text)
    assert info.value.field == field


def test_config_section() -> None:
    eps = endpoints_from_config(
        {"staticEndpoints": ["10.0.0.1:8000", {"address": "10.0.0.2", "port": 8000, "metricsPort": 9000, "engine": "sglang", "labels": {"zone": "a"}}]}
    )
    assert eps[1].metrics_port == 9000 and eps[1].labels == {"zone": "a", ENGINE_LABEL: "sglang"}
    ranks = endpoints_from_config({"staticEndpoints": [{"address": "10.0.0.2", "port": 8000},
                                                       {"address": "10.0.0.2", "port": 8001, "rank": 1}]})  # fmt: skip
    assert [e.rank for e in ranks] == [0, 1]
    with pytest.raises(ConfigError) as info:
        endpoints_from_config({"staticEndpoints": [{"address": "x", "port": 0}]})
    assert info.value.field == "staticEndpoints[0].port"


def test_unknown_engine_names_the_field() -> None:
    with pytest.raises(ConfigError) as info:
        endpoints_from_config({"staticEndpoints": [{"address": "10.0.0.2", "port": 8000, "engine": "tgi"}]})
    assert info.value.field == "staticEndpoints[0].engine"
    assert "vllm, sglang" in info.value.problem
