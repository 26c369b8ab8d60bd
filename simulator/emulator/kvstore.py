"""A KV store shared by emulators through a directory: vLLM's ``ExampleConnector`` in
``kv_both`` role, emulated.

vLLM's example connector writes the KV of every prompt it computes to a shared directory and,
before computing a prompt, loads the leading part another server wrote there. The emulators
have no KV to write, so a block is a file named by its hash (empty); a decoder's engine is
told how many leading prompt tokens it may load (``EngineRequest.external_tokens``) and
charges them as loaded, and the load as ``CostModel.kv_transfer_s``. This is what
disaggregated prefill needs: a prefiller (a request with ``max_tokens: 1``) stores the
prompt, the decoder that gets the request next finds it.

Bounded: each emulator removes the oldest blocks it wrote beyond ``max_blocks``.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path


class SharedKvStore:
    def __init__(self, directory: str | Path, max_blocks: int = 1_000_000) -> None:
        if max_blocks < 1:
            raise ValueError(f"KV store: max_blocks must be >= 1, got {max_blocks}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_blocks = max_blocks
        self._written: OrderedDict[int, None] = OrderedDict()
        self.saved_blocks = 0
        """Blocks this server wrote (counted once each while they stay)."""

    def _path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash & (2**64 - 1):016x}"

    def save(self, block_hashes: Sequence[int]) -> None:
        """The KV of these blocks (a computed prompt's full blocks) is now in the store."""
        written = self._written
        for h in block_hashes:
            if h in written:
                written.move_to_end(h)
                continue
            self._path(h).touch()
            written[h] = None
            self.saved_blocks += 1
        while len(written) > self.max_blocks:
            old, _ = written.popitem(last=False)
            with contextlib.suppress(OSError):
                self._path(old).unlink()

    def leading(self, block_hashes: Sequence[int]) -> int:
        """How many of the prompt's leading blocks the store holds (any server's)."""
        n = 0
        for h in block_hashes:
            if not self._path(h).exists():
                break
            n += 1
        return n
