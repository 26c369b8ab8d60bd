"""KV-cache events from the model servers (ZMQ) for the precise prefix producer."""
