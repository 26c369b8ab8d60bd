"""Pure-Python model of one vLLM replica: tokens, prefix KV cache, step costs, engine.

No asyncio or HTTP here: the live emulator drives it with the wall clock, the offline
replayer with a simulated one.
"""

from simulator.model.cache import (
    Allocation,
    BlockHash,
    PrefixCache,
    chain_block_ids,
    model_seed,
    text_block_hashes,
)
from simulator.model.cost import CostModel
from simulator.model.engine import (
    Engine,
    EngineConfig,
    EngineRequest,
    Finished,
    FirstToken,
    RequestTooLarge,
    StepResult,
)
from simulator.model.tokens import CHARS_PER_TOKEN, count_tokens, generate_text

__all__ = [
    "CHARS_PER_TOKEN",
    "Allocation",
    "BlockHash",
    "CostModel",
    "Engine",
    "EngineConfig",
    "EngineRequest",
    "Finished",
    "FirstToken",
    "PrefixCache",
    "RequestTooLarge",
    "StepResult",
    "chain_block_ids",
    "count_tokens",
    "generate_text",
    "model_seed",
    "text_block_hashes",
]
