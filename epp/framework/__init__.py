"""The ground floor: the value types and extension points every other package builds on.

``endpoint`` (an endpoint and its metrics), ``request`` (a parsed inference request),
``types`` (a scheduling cycle's state and results), ``interfaces`` (the plugin kinds and
their hooks, the plugin lifecycle), ``observation`` (what a replica saw of another's
request: the response observer publishes it, index sync carries it), ``pool`` (the
endpoints a cycle picks from, with the look-ups a shortlist needs), ``saturation`` and
``shortlist`` (those config sections' values). It imports no other epp package, so a plugin, the
datastore, the scheduler and the simulator can all stand on it without standing on each
other.
"""
