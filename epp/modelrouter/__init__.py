"""Many models behind one gateway: ``epp model-router``, the body-based router.

The gateway's first ext_proc reads each request's model from its body with epp's request
parser (``epp.request``), looks it up in the catalog (``catalog``: the pools' base models and
their LoRA adapters, from configuration, Kubernetes ConfigMaps in llm-d's payload
processor's format, and the servers' own ``GET /v1/models``) and sets
``x-gateway-model-name`` / ``x-gateway-base-model-name``; the gateway's routes match the
latter and send the request to that pool, whose epp picks the server. ``listing`` serves one
``GET /v1/models`` for the whole gateway; ``pools`` reads the pools (``--pool``,
``--pools``), shared with ``epp envoy-config``; ``stream`` is the ext_proc state machine,
``server`` the process, ``cli`` the command line. docs/envoy.md and docs/kubernetes.md
("Several models") show the deployments.
"""
