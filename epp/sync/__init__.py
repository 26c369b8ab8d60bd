"""Index sync between epp replicas: each replica streams the prefix-index writes it made
itself to its peers and applies theirs (docs/sync.md). The gRPC code lives here; the prefix
package only exposes the producer's ``on_record`` / ``apply_remote`` seams."""
