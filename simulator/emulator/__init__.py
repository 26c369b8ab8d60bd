"""A vLLM-compatible model-server emulator: OpenAI API, vLLM metrics, modelled timings.

Start one in-process with :func:`start_emulator`, or from the shell with
``epp-sim emulate``.
"""

from simulator.emulator.config import EmulatorConfig
from simulator.emulator.server import Emulator, RunningEmulator, start_emulator

__all__ = ["Emulator", "EmulatorConfig", "RunningEmulator", "start_emulator"]
