"""The decode-side sidecar of disaggregated serving (``epp pd-sidecar``): see ``proxy``."""
