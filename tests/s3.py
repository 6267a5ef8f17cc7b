"""A real S3-compatible HTTP server for tests (moto's server mode, on 127.0.0.1), and its client."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from tests import harness

# moto accepts any credentials; boto3 (in the tests and in a `dlora serve` they start) needs some.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """Start the server and put the credentials in this process's environment (inherited by any
    server the test starts); yields the endpoint URL."""
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    port = harness.free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint)


def upload_adapter(s3, bucket: str, prefix: str, adapter_dir: Path) -> None:
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        s3.upload_file(str(adapter_dir / f), bucket, f"{prefix}/{f}")
