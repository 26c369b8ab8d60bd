"""The ``approx-prefix-cache-producer`` plugin: the prefix match learnt from epp's own
routing and the replies (chained chunk hashes in ``epp.prefix.index``).

It is the producer of the prefix match by default: the config loader adds it when a plugin
reads the match and no producer is configured (the registry's ``DEFAULT_PRODUCERS``). Index
sync shares its index with the pool's other replicas (it is the ``SharedIndex`` the sync
looks for). Its tests are in tests/unit/plugins/approxprefix/.
"""

from epp.plugins.approxprefix.producer import (
    APPROX_PREFIX_PRODUCER,
    PrefixIndexConfig,
    PrefixProducer,
    RecordSink,
)

__all__ = ["APPROX_PREFIX_PRODUCER", "PrefixIndexConfig", "PrefixProducer", "RecordSink"]
