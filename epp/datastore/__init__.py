"""Endpoints of the pool and their latest metrics, fed by a static list or Kubernetes."""
