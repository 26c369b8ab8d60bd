"""Simulator: vLLM-compatible model-server emulator, dev gateway and offline trace replay.

``simulator.model`` holds the pure-Python replica model (prefix KV cache, cost model,
continuous-batching engine) shared by the live emulator and the offline replayer.
``simulator.emulator`` wraps one engine in an aiohttp server that speaks the OpenAI API.
"""
