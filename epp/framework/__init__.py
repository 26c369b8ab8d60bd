"""The ground floor: the value types and extension points every other package builds on.

``endpoint`` (an endpoint and its metrics), ``request`` (a parsed inference request),
``types`` (a scheduling cycle's state and results) and ``interfaces`` (the plugin kinds and
their hooks, the plugin lifecycle). It imports no other epp package, so a plugin, the
datastore, the scheduler and the simulator can all stand on it without standing on each
other.
"""
