"""The pools of ``--pool`` / ``--pools`` and the adapters: parsed, checked, errors naming the
flag or the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp.envoyconfig import PoolRoute
from epp.errors import ConfigError
from epp.modelrouter.cli import envoy_pools
from epp.modelrouter.pools import as_mapping, from_flags, load_pools_file, parse_pool_flag


def test_a_pool_flag_names_its_models_and_servers() -> None:
    assert parse_pool_flag("chat=meta-llama/Llama-3.1-8B,llama@10.0.0.1:8000, vllm.ns.svc:8000") == \
        PoolRoute("chat", ("meta-llama/Llama-3.1-8B", "llama"), ("10.0.0.1:8000", "vllm.ns.svc:8000"))  # fmt: skip


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("chat@10.0.0.1:8000", "NAME=MODEL"),
        ("chat=m", "NAME=MODEL"),
        ("Chat_1=m@10.0.0.1:8000", "DNS label"),
        ("chat=@10.0.0.1:8000", "base models"),
        ("chat=m@", "servers"),
        ("chat=m@10.0.0.1", "not host:port"),
        ("chat=" + "m" * 300 + "@10.0.0.1:8000", "at most 256"),
    ],
)
def test_a_bad_pool_flag_says_what_is_wrong(text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words) as err:
        parse_pool_flag(text)
    assert err.value.field.startswith("--pool")


def test_flags_with_adapters_and_epps() -> None:
    pools = from_flags(["chat=c@10.0.0.1:8000", "coder=k@10.0.0.2:8000"], ["c=sql-lora,support"],
                       ["coder=10.0.1.2:9002"])  # fmt: skip
    assert pools is not None
    assert [p.epp for p in pools.pools] == [(), ("10.0.1.2:9002",)]
    assert pools.adapter_map() == {"sql-lora": "c", "support": "c"}


@pytest.mark.parametrize(
    ("flags", "adapters", "words"),
    [
        (["a=m@10.0.0.1:8000", "a=n@10.0.0.2:8000"], [], "named twice"),
        (["a=m@10.0.0.1:8000", "b=m@10.0.0.2:8000"], [], "in pools 'a' and 'b'"),
        (["a=m@10.0.0.1:8000"], ["other=x"], "is in no pool"),
        (["a=m,n@10.0.0.1:8000"], ["m=n"], "a base model"),
        ([], ["m=x"], "adapters belong"),
    ],
)
def test_pools_that_cannot_work_are_refused(flags: list[str], adapters: list[str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        from_flags(flags, adapters)


def test_the_pools_file_in_the_payload_processors_adapter_format(tmp_path: Path) -> None:
    path = tmp_path / "pools.yaml"
    path.write_text(
        "pools:\n"
        "- {name: chat, models: [llama], servers: [10.0.0.1:8000], epp: [10.0.1.1:9002]}\n"
        "- {name: coder, models: [qwen], servers: ['vllm-coder.ns.svc:8000']}\n"
        "adapters:\n- {baseModel: llama, adapters: [sql-lora]}\n"
    )
    pools = load_pools_file(path)
    assert [p.name for p in pools.pools] == ["chat", "coder"]
    assert pools.pools[0].epp == ("10.0.1.1:9002",)
    assert pools.adapter_map() == {"sql-lora": "llama"}
    assert as_mapping(pools)["adapters"] == [{"baseModel": "llama", "adapters": ["sql-lora"]}]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("pools: []\n", "pools"),
        ("pools:\n- {name: chat, models: [m], servers: [x]}\n", "not host:port"),
        ("pools:\n- {name: chat, models: [m], servers: ['a:1'], color: red}\n", "color"),
        ("pools:\n- {name: chat, models: [m]}\nadapters:\n- {baseModel: z, adapters: [a]}\n", "no pool"),
        ("[1, 2]\n", "mapping"),
    ],
)
def test_a_bad_pools_file_names_the_field(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "pools.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words):
        load_pools_file(path)


def test_envoy_config_keeps_its_single_pool_form_and_refuses_a_mix() -> None:
    assert envoy_pools(["10.0.0.1:8000,10.0.0.2:8000"], ["127.0.0.1:9002"], "") == ()
    pools = envoy_pools(["chat=m@10.0.0.1:8000"], ["chat=127.0.0.1:9002"], "")
    assert pools[0].epp == ("127.0.0.1:9002",)
    with pytest.raises(ConfigError, match="not both"):
        envoy_pools(["10.0.0.1:8000", "chat=m@10.0.0.1:8000"], [], "")
    with pytest.raises(ConfigError, match="NAME=HOST:PORT"):
        envoy_pools(["chat=m@10.0.0.1:8000"], ["127.0.0.1:9002"], "")
    with pytest.raises(ConfigError, match="no pool named"):
        envoy_pools(["chat=m@10.0.0.1:8000"], ["coder=127.0.0.1:9002"], "")
