"""LoRA adapters from Kubernetes ConfigMaps, in llm-d's payload processor's format.

The payload processor (the Inference Extension's body-based router, continued in llm-d)
learns which base model an adapter belongs to from ConfigMaps labelled
``app.kubernetes.io/managed-by: ipp`` whose ``data.config`` is YAML::

    baseModel: meta-llama/Llama-3.1-8B-Instruct
    adapters: [sql-lora, support-lora]

``epp model-router --adapter-configmaps-namespace NS`` watches those ConfigMaps (a reflector
thread: list, watch, re-list, back off; ``epp.datastore.kubernetes``) and gives each one's
adapters to the catalog as the source ``configmap:NS/NAME``; a ConfigMap deleted or
relabelled takes its adapters away. A ConfigMap whose ``data.config`` is not that shape is
skipped with a warning naming it (its earlier adapters are dropped). Needs ``get, list,
watch`` on ConfigMaps in that namespace (the chart's Role).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
from typing import Any

import yaml
from kubernetes import client

from epp.datastore.kubernetes import DiscoveryError, RawObject, WatchTiming, load_api_client
from epp.datastore.kubernetes.objects import DEFAULT_TIMING
from epp.datastore.kubernetes.reflector import _Changed, _Delta, _Listed, _Reflector
from epp.errors import ConfigError
from epp.modelrouter.catalog import ModelCatalog
from epp.modelrouter.pools import MAX_MODEL_CHARS

log = logging.getLogger(__name__)

DEFAULT_SELECTOR = "app.kubernetes.io/managed-by=ipp"
MAX_ADAPTERS_PER_CONFIGMAP = 10_000


def adapters_of(config_map: RawObject) -> dict[str, str]:
    """``data.config`` of one ConfigMap -> adapter -> base model (ValueError: not that shape)."""
    text = (config_map.get("data") or {}).get("config")
    if not isinstance(text, str):
        raise ValueError("no data.config")
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"data.config is not YAML: {str(exc)[:200]}") from None
    if not isinstance(doc, dict):
        raise ValueError("data.config is not a mapping")
    base, adapters = doc.get("baseModel"), doc.get("adapters") or []
    if not isinstance(base, str) or not 0 < len(base) <= MAX_MODEL_CHARS:
        raise ValueError("data.config.baseModel is not a model name")
    if not isinstance(adapters, list) or len(adapters) > MAX_ADAPTERS_PER_CONFIGMAP:
        raise ValueError(f"data.config.adapters is not a list of at most "
                         f"{MAX_ADAPTERS_PER_CONFIGMAP} names")  # fmt: skip
    out = {}
    for a in adapters:
        if not isinstance(a, str) or not 0 < len(a) <= MAX_MODEL_CHARS:
            raise ValueError("data.config.adapters holds something that is not a model name")
        out[a] = base
    return out


class ConfigMapAdapters:
    """Feeds a :class:`ModelCatalog` from the ConfigMaps of one namespace."""

    def __init__(
        self,
        catalog: ModelCatalog,
        namespace: str,
        selector: str = DEFAULT_SELECTOR,
        *,
        api_client: client.ApiClient | None = None,
        timing: WatchTiming = DEFAULT_TIMING,
    ) -> None:
        self._catalog = catalog
        self._namespace = namespace
        self._selector = selector
        self._api_client = api_client
        self._timing = timing
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reflector: _Reflector | None = None
        self._known: set[str] = set()
        self._listed = asyncio.Event()
        self._last_error = ""

    def describe(self) -> str:
        return f"ConfigMaps {self._selector!r} in namespace {self._namespace}"

    async def start(self) -> None:
        """Returns after the first full list (``DiscoveryError`` if none comes in time)."""
        self._loop = asyncio.get_running_loop()
        api = self._api_client or await asyncio.to_thread(load_api_client)
        core = client.CoreV1Api(api)
        self._reflector = _Reflector(
            name="configmaps",
            list_call=functools.partial(core.list_namespaced_config_map, self._namespace),
            deliver=lambda delta: self._post(self._apply, delta),
            report_error=lambda text: self._post(self._set_error, text),
            timing=self._timing,
            label_selector=self._selector,
        )
        self._reflector.start()
        try:
            await asyncio.wait_for(self._listed.wait(), self._timing.sync_timeout_s)
        except TimeoutError:
            await self.stop()
            raise DiscoveryError(f"{self.describe()}: no full list within "
                                 f"{self._timing.sync_timeout_s:g}s (last problem: "
                                 f"{self._last_error or 'no answer'})") from None  # fmt: skip
        log.info("%s: listed, %d with adapters", self.describe(), len(self._known))

    async def stop(self) -> None:
        reflector, self._reflector = self._reflector, None
        if reflector is not None:
            reflector.stop()
            await asyncio.to_thread(reflector.join, self._timing.stop_timeout_s)

    def _post(self, fn: Any, *args: Any) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed
                loop.call_soon_threadsafe(fn, *args)

    def _set_error(self, text: str) -> None:
        self._last_error = text

    def _apply(self, delta: _Delta) -> None:
        if isinstance(delta, _Listed):
            listed = set()
            for item in delta.items:
                listed.add(self._update(item))
            for gone in self._known - listed:
                self._catalog.set_adapters(gone, {})
            self._known = listed
            self._listed.set()
        elif isinstance(delta, _Changed):
            if delta.type == "DELETED":
                source = self._source(delta.object)
                self._catalog.set_adapters(source, {})
                self._known.discard(source)
            else:
                self._known.add(self._update(delta.object))

    def _source(self, obj: RawObject) -> str:
        return f"configmap:{self._namespace}/{(obj.get('metadata') or {}).get('name', '?')}"

    def _update(self, obj: RawObject) -> str:
        source = self._source(obj)
        try:
            adapters = adapters_of(obj)
        except ValueError as exc:
            log.warning("%s: skipped: %s", source, exc)
            adapters = {}
        self._catalog.set_adapters(source, adapters)
        return source


def add_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Kubernetes: adapters from ConfigMaps (llm-d's payload processor's format)")
    g.add_argument("--adapter-configmaps-namespace", default="",
                   help="watch the ConfigMaps of this namespace that --adapter-configmaps-selector "
                   "selects: data.config {baseModel: M, adapters: [A, ...]} maps each adapter to "
                   "M's pool (off when empty)")
    g.add_argument("--adapter-configmaps-selector", default=DEFAULT_SELECTOR,
                   help="label selector of those ConfigMaps")


def source_from_args(args: argparse.Namespace) -> Any:
    """The ConfigMap source the flags ask for (a start function), or None."""
    if not args.adapter_configmaps_namespace:
        return None
    if not args.adapter_configmaps_selector:
        raise ConfigError("--adapter-configmaps-selector", "give a label selector")

    async def start(catalog: ModelCatalog) -> ConfigMapAdapters:
        source = ConfigMapAdapters(catalog, args.adapter_configmaps_namespace,
                                   args.adapter_configmaps_selector)  # fmt: skip
        await source.start()
        return source

    return start
