"""Which pool serves a model: base models, adapters from each source by precedence, bounds."""

from __future__ import annotations

import json

from epp.envoyconfig import PoolRoute
from epp.modelrouter.catalog import CONFIG, ModelCatalog, ModelRoute
from epp.modelrouter.listing import ModelLister, parse_model_list

POOLS = (PoolRoute("chat", ("llama",), ("10.0.0.1:8000",)),
         PoolRoute("coder", ("qwen", "qwen-alias"), ("10.0.0.2:8000",)))  # fmt: skip


def test_base_models_route_to_their_pool_and_an_unknown_model_to_none() -> None:
    c = ModelCatalog(POOLS)
    assert c.lookup("llama") == ModelRoute("llama", "llama", "chat")
    assert c.lookup("qwen-alias") == ModelRoute("qwen-alias", "qwen-alias", "coder")
    assert c.lookup("gpt-9") is None


def test_an_adapter_routes_to_its_base_models_pool() -> None:
    c = ModelCatalog(POOLS)
    c.set_adapters(CONFIG, {"sql-lora": "llama"})
    route = c.lookup("sql-lora")
    assert route == ModelRoute("sql-lora", "llama", "chat") and route.adapter


def test_configuration_wins_over_configmaps_which_win_over_what_servers_list() -> None:
    c = ModelCatalog(POOLS)
    c.set_adapters("learned:coder", {"a": "qwen", "b": "qwen", "c": "qwen"})
    c.set_adapters("configmap:ns/x", {"a": "llama", "b": "llama"})
    c.set_adapters(CONFIG, {"a": "qwen"})
    assert (c.lookup("a").pool, c.lookup("b").pool, c.lookup("c").pool) == ("coder", "chat", "coder")  # type: ignore[union-attr]
    c.set_adapters("configmap:ns/x", {})  # the ConfigMap went away
    assert c.lookup("b").pool == "coder"  # type: ignore[union-attr]


def test_adapters_of_no_pool_or_named_like_a_base_model_are_ignored() -> None:
    c = ModelCatalog(POOLS)
    c.set_adapters("configmap:ns/x", {"x": "mistral", "qwen": "llama", "ok": "llama"})
    assert c.lookup("x") is None and c.lookup("qwen").pool == "coder"  # type: ignore[union-attr]
    assert c.lookup("ok") is not None and c.ignored == 2


def test_the_catalog_is_bounded() -> None:
    c = ModelCatalog(POOLS, max_models=5)
    c.set_adapters("learned:chat", {f"a{i}": "llama" for i in range(100)})
    assert len(c.routes) == 5 and c.ignored == 98


def test_the_model_list_holds_every_routed_model_once_with_the_servers_cards() -> None:
    c = ModelCatalog(POOLS)
    c.set_adapters(CONFIG, {"sql-lora": "llama"})
    lister = ModelLister(POOLS, c, clock=lambda: 1000.0)
    lister._seen["chat"] = parse_model_list(json.dumps({"object": "list", "data": [
        {"id": "llama", "object": "model", "owned_by": "vllm", "max_model_len": 8192},
        {"id": "llama", "object": "model", "owned_by": "someone else"},
        {"id": "not-routed", "object": "model"}, "junk", {"id": 7}]}).encode(), 100)  # fmt: skip
    lister._changes += 1
    listed = json.loads(lister.body())
    assert [m["id"] for m in listed["data"]] == ["llama", "qwen", "qwen-alias", "sql-lora"]
    assert listed["data"][0]["owned_by"] == "vllm" and listed["data"][0]["max_model_len"] == 8192
    assert listed["data"][3] == {"id": "sql-lora", "object": "model", "created": 1000,
                                 "owned_by": "epp", "root": "sql-lora", "parent": "llama"}  # fmt: skip
    assert json.loads(lister.card("qwen") or b"")["id"] == "qwen"
    assert lister.card("gpt-9") is None
