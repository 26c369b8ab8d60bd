"""Smoke-test epp's image: start ``epp serve`` inside it (the command given, with {grpc},
{health}, {metrics} and {endpoints} filled in), then check what a cluster would: gRPC health
(liveness, readiness, "") on both ports, Prometheus metrics, and requests routed by it through
real Envoy to an emulated model server.

    python scripts/image_smoke.py -- buildah run CONTAINER -- epp serve --host 127.0.0.1 \\
        --grpc-port {grpc} --health-port {health} --metrics-port {metrics} --endpoints {endpoints}
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


async def health(port: int, service: str) -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            r = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))


async def main(command: list[str]) -> int:
    import aiohttp

    from epp.envoyconfig import EnvoyOptions
    from simulator.envoy import start_envoy, with_ports
    from simulator.stack import child
    from simulator.vllm import free_port

    reps = await child.start_replicas(1, 20.0, "meta-llama/Llama-3.1-8B-Instruct", None, None)
    endpoint = reps[0].url.removeprefix("http://")
    ports = {"grpc": free_port(), "health": free_port(), "metrics": free_port()}
    argv = [a.format(endpoints=endpoint, **ports) for a in command]
    print("starting:", " ".join(argv), flush=True)
    proc = await asyncio.create_subprocess_exec(*argv)
    failures = []
    try:
        deadline = time.monotonic() + 60
        while await health(ports["grpc"], "readiness") != "SERVING":
            if proc.returncode is not None:
                print(f"epp exited with {proc.returncode}")
                return 1
            if time.monotonic() > deadline:
                print("epp never became ready")
                return 1
            await asyncio.sleep(0.2)
        for port_name in ("grpc", "health"):
            for service in ("liveness", "readiness", ""):
                status = await health(ports[port_name], service)
                print(f"health {service or '(all)':>9} on the {port_name} port: {status}")
                if status != "SERVING":
                    failures.append(f"{service} on {port_name}")
        envoy = await start_envoy(with_ports(EnvoyOptions(
            epp=(f"127.0.0.1:{ports['grpc']}",), pool=(endpoint,), upstream_host_header=True)),
            Path(tempfile.mkdtemp(prefix="image-smoke-")))  # fmt: skip
        try:
            async with aiohttp.ClientSession() as http:
                body = {
                    "model": "meta-llama/Llama-3.1-8B-Instruct",
                    "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hello from the image"}],
                }
                async with http.post(envoy.url + "/v1/chat/completions", json=body) as r:
                    print(
                        f"request through Envoy: HTTP {r.status}, served by "
                        f"{r.headers.get('x-upstream-host')}"
                    )
                    if r.status != 200:
                        failures.append(f"HTTP {r.status}")
                # epp counts a request when its response stream ends, which Envoy may send on
                # after the client has its reply: poll for a few seconds.
                routed = 0.0
                until = time.monotonic() + 10
                while routed < 1 and time.monotonic() < until:
                    async with http.get(f"http://127.0.0.1:{ports['metrics']}/metrics") as r:
                        routed = sum(
                            float(line.rsplit(" ", 1)[1])
                            for line in (await r.text()).splitlines()
                            if line.startswith("epp_requests_total{")
                        )
                    if routed < 1:
                        await asyncio.sleep(0.2)
            print(f"routed by epp in the image: {routed:g} request(s)")
            stats = await envoy.counters("http.inference.ext_proc.failure_mode_allowed")
            if routed < 1 or sum(stats.values()):
                failures.append("not routed by epp")
        finally:
            await envoy.stop()
    finally:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        for r in reps:
            await r.close()
    print("image smoke test: " + ("FAILED: " + ", ".join(failures) if failures else "passed"))
    return 1 if failures else 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        sys.exit(__doc__)
    sys.exit(asyncio.run(main(args)))
