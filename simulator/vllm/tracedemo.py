"""One request's trace across the gateway into real vLLM, printed as a tree.

    ./run python -m simulator.vllm.tracedemo [--keep-logs DIR]

An OTLP/HTTP receiver (``simulator.otlp``), a real vLLM server started with
``--otlp-traces-endpoint`` pointing at it, ``epp serve`` with only the ``OTEL_*`` variables
set, and real Envoy in front. A streamed chat request goes through Envoy carrying a client's
``traceparent``; the receiver then holds epp's spans and vLLM's ``llm_request`` in that one
trace, vLLM's under epp's ``epp.upstream`` (the ``traceparent`` epp set on the request Envoy
sent to vLLM). tests/vllm/test_tracing.py runs the same and checks it; docs/observability.md
shows its output.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from epp.envoyconfig import EnvoyOptions
from simulator.envoy import start_envoy, with_ports
from simulator.otlp import PRINTED, OtlpReceiver, ReceivedSpan, tree
from simulator.vllm import (
    ServerOptions,
    ensure_vllm_tracing,
    free_port,
    start_server,
    wait_healthy,
)

MODEL = "tiny"
SHOWN = (*PRINTED, "gen_ai.latency.time_to_first_token", "gen_ai.latency.time_in_queue", "server.address")


@dataclass(slots=True, frozen=True)
class TracedRequest:
    trace_id: str
    client_span_id: str
    spans: list[ReceivedSpan]

    def tree(self) -> str:
        return tree(self.spans, SHOWN)


async def trace_one_request(workdir: Path) -> TracedRequest:
    """Start the receiver, vLLM, epp and Envoy; send one traced request; return its spans
    once both epp's and vLLM's have arrived (module docstring)."""
    receiver = await OtlpReceiver().start()
    procs: list[asyncio.subprocess.Process] = []
    envoy = None
    try:
        setup = await asyncio.to_thread(ensure_vllm_tracing, lambda m: print(m, file=sys.stderr))
        options = ServerOptions(model_name=MODEL, otlp_traces_endpoint=f"{receiver.endpoint}/v1/traces")
        server, proc = await start_server(setup, 0, options, workdir / "vllm.log")
        procs.append(proc)
        await wait_healthy(f"http://{server}/health", proc, workdir / "vllm.log")
        grpc_port, metrics_port = free_port(), free_port()
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
               "OTEL_BSP_SCHEDULE_DELAY": "200"}  # fmt: skip
        with open(workdir / "epp.log", "ab") as log:  # noqa: ASYNC230 - handed to the child
            epp = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "epp.cli", "serve", "--host", "127.0.0.1", "--grpc-port",
                str(grpc_port), "--health-port", "-1", "--metrics-port", str(metrics_port),
                "--log-format", "text", "--endpoints", server,
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                start_new_session=True,
            )  # fmt: skip
        procs.append(epp)
        envoy = await start_envoy(with_ports(EnvoyOptions(epp=(f"127.0.0.1:{grpc_port}",), pool=(server,))),
                                  workdir)  # fmt: skip
        trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
        body = {"model": MODEL, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": "Tell me about bread. " * 20}]}  # fmt: skip
        async with aiohttp.ClientSession() as http:
            await _until_epp_routes(http, envoy.url, body)
            async with http.post(envoy.url + "/v1/chat/completions", json=body,
                                 headers={"traceparent": f"00-{trace_id}-{parent}-01"}) as r:  # fmt: skip
                if r.status != 200:
                    raise RuntimeError(f"the traced request got HTTP {r.status}: {await r.text()}")
                await r.read()

        def both(spans: object) -> bool:
            names = {(s.service, s.name) for s in receiver.trace(trace_id)}
            return ("epp", "epp.request") in names and any(svc == "vllm" for svc, _ in names)

        await receiver.wait_for(both, 60)
        await asyncio.sleep(0.5)  # a late span of the same export round
        return TracedRequest(trace_id, parent, receiver.trace(trace_id))
    finally:
        if envoy is not None:
            await envoy.stop()
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        await receiver.stop()


async def _until_epp_routes(http: aiohttp.ClientSession, url: str, body: dict[str, object]) -> None:
    """Envoy serves without epp until its health check passes (the fail-open marker says so)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while True:
        async with http.post(url + "/v1/chat/completions", json=body) as r:
            await r.read()
            if "x-epp-fail-open" not in r.headers:
                return
        if loop.time() > deadline:
            raise RuntimeError("epp never routed a request")
        await asyncio.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulator.vllm.tracedemo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--keep-logs", default="", help="write vLLM's, epp's and Envoy's logs there")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.keep_logs or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        traced = asyncio.run(trace_one_request(workdir))
    print(f"client traceparent: 00-{traced.trace_id}-{traced.client_span_id}-01")
    print(traced.tree(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
