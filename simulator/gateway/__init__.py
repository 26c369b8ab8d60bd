"""Development gateway: an aiohttp front proxy that plays Envoy's ext_proc part for epp.

``start_gateway(GatewayOptions(...))`` is the programmatic entry point; ``epp-sim gateway``
the command line one. See docs/local-stack.md for the Envoy behaviours it reproduces.
"""

from simulator.gateway.extproc import BUFFERED, FULL_DUPLEX_STREAMED, MODE_NAMES, NONE, STREAMED
from simulator.gateway.proxy import (
    DESTINATION_HEADER,
    POLICIES,
    UPSTREAM_HOST_HEADER,
    GatewayOptions,
)
from simulator.gateway.server import GatewayHandle, start_gateway
from simulator.gateway.upstream import GatewayStats

__all__ = [
    "BUFFERED",
    "DESTINATION_HEADER",
    "FULL_DUPLEX_STREAMED",
    "MODE_NAMES",
    "NONE",
    "POLICIES",
    "STREAMED",
    "UPSTREAM_HOST_HEADER",
    "GatewayHandle",
    "GatewayOptions",
    "GatewayStats",
    "start_gateway",
]
