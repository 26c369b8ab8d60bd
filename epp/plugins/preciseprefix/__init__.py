"""The ``precise-prefix-cache-producer`` plugin (docs/precise-prefix.md): the prefix match
from the model servers' KV-cache events.

Everything the plugin is lives here: its parameters (``params``), how it keys a request as
vLLM does (``keyer``), the events' wire format (``events``), the ZMQ subscription it starts
and stops itself (``subscriber``, through the ``Lifecycle`` hook), its metrics (``metrics``)
and the producer (``producer``). Its tests are in tests/unit/plugins/preciseprefix/ and
tests/integration/test_kv_events.py.
"""

from epp.plugins.preciseprefix.keyer import TokenizingKeyer
from epp.plugins.preciseprefix.params import (
    KEYING_S_PER_BODY_BYTE,
    PRECISE_PREFIX_PRODUCER,
    PreciseIndexConfig,
)
from epp.plugins.preciseprefix.producer import PrecisePrefixProducer

__all__ = ["KEYING_S_PER_BODY_BYTE", "PRECISE_PREFIX_PRODUCER", "PreciseIndexConfig",
           "PrecisePrefixProducer", "TokenizingKeyer"]
