"""`epp serve --pool-name` finds its pods through a kubeconfig, as it would outside a cluster."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.fake_k8s import OBJECTIVES, PODS, POOLS, FakeKubeApi, pod, pool

pytestmark = pytest.mark.e2e

EPP = Path(sys.executable).with_name("epp")


@pytest.fixture
def api() -> Iterator[FakeKubeApi]:
    fake = FakeKubeApi()
    for collection in (PODS("models"), POOLS("models"), OBJECTIVES("models")):
        fake.create_collection(collection)
    fake.start()
    yield fake
    fake.close()


def kubeconfig(tmp_path: Path, server: str) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": server}}],
                "users": [{"name": "nobody", "user": {}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "nobody"}}],
                "current-context": "fake",
            }
        )
    )
    return path


class Lines:
    """The process's stderr, line by line, with a deadline per wait."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self._q: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        assert proc.stderr is not None
        stream = proc.stderr
        threading.Thread(target=lambda: [self._q.put(x) for x in stream], daemon=True).start()

    def wait_for(self, text: str, timeout_s: float = 15.0) -> None:
        while not any(text in line for line in self.seen):
            try:
                self.seen.append(self._q.get(timeout=timeout_s))
            except queue.Empty:
                raise AssertionError(f"no {text!r} in:\n{''.join(self.seen)}") from None


@pytest.mark.skipif(not EPP.exists(), reason="epp console script not installed")
def test_serve_discovers_the_pool_through_kubeconfig(api: FakeKubeApi, tmp_path: Path) -> None:
    api.put(POOLS("models"), pool("llama", {"app": "vllm"}, [8000]))
    api.put(PODS("models"), pod("a", "127.0.0.1"))
    env = dict(os.environ, KUBECONFIG=str(kubeconfig(tmp_path, api.host)))
    env.pop("KUBERNETES_SERVICE_HOST", None)  # not in a cluster: use the kubeconfig
    argv = [str(EPP), "serve", "--grpc-port=0", "--health-port=0", "--metrics-port=0"]
    argv += ["--pool-name=llama", "--pool-namespace=models", "--log-format=text"]
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines = Lines(proc)
        lines.wait_for("InferencePool models/llama: synced, 1 endpoints")
        api.delete(PODS("models"), "a")
        lines.wait_for("endpoint 127.0.0.1:8000 left the pool")
    finally:
        proc.terminate()
        proc.wait(timeout=15)
