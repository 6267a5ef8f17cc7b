"""A real S3-compatible HTTP server for tests (moto's server mode, on 127.0.0.1), and its client."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests import harness

# moto accepts any credentials; boto3 (in the tests and in a `dlora serve` they start) needs some.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """Start the server in its own process and put the credentials in this process's environment
    (inherited by any server the test starts); yields the endpoint URL. Its own process, not a
    thread: moto's server imports Flask, whose module-level proxies raise when vLLM, starting an
    engine later in the same test process, inspects every loaded module."""
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    port = harness.free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_until_up(url, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _wait_until_up(url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the S3 server exited with {proc.returncode}")
        try:
            httpx.get(url, timeout=2)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise TimeoutError(f"the S3 server at {url} did not answer within {timeout_s} s")


def client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint)


def upload_adapter(s3, bucket: str, prefix: str, adapter_dir: Path) -> None:
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        s3.upload_file(str(adapter_dir / f), bucket, f"{prefix}/{f}")
