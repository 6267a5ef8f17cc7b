"""Adapters from an S3-compatible object store: `s3://<bucket>/<prefix>/<name>/` holds the adapter's
`adapter_config.json` and `adapter_model.safetensors` (`server.adapter_s3_uri`).

The two objects are downloaded into dlora's own directory (`<state_dir>/resolved/`), to a temporary
name first so a half-written download is never registered, and the result is registered like any
other adapter: validated, then copied into the snapshot engines read. Only those two keys are ever
fetched, each at most MAX_OBJECT_BYTES, so a bucket cannot make the server read anything else or fill
its disk. Credentials come from the standard AWS environment (AWS_ACCESS_KEY_ID, ...); boto3 is
imported only when this resolver is configured.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import threading
from pathlib import Path

from dlora.adapters.resolver import AdapterSourceError, is_resolvable_name
from dlora.adapters.snapshot import SNAPSHOT_FILES
from dlora.adapters.validate import AdapterValidationError

MAX_OBJECT_BYTES = 4 << 30  # larger than any LoRA adapter of a model dlora serves on one replica


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """(bucket, key prefix without slashes at either end) of `s3://bucket[/prefix]`."""
    if not uri.startswith("s3://") or not uri[5:].split("/", 1)[0]:
        raise ValueError(f"{uri!r} is not an s3://bucket[/prefix] URI")
    bucket, _, prefix = uri[5:].partition("/")
    return bucket, prefix.strip("/")


def download_dir_name(name: str) -> str:
    """A flat directory name for an adapter name that may contain '/', distinct for distinct names."""
    return f"{name.replace('/', '_')}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"


class S3Resolver:
    # What it returns lies in dlora's own download directory, not under server.adapter_roots.
    local_roots_apply = False

    def __init__(self, uri: str, endpoint_url: str | None, download_root: Path) -> None:
        self.bucket, self.prefix = parse_s3_uri(uri)
        self.endpoint_url = endpoint_url
        self.download_root = download_root
        self._client = None
        self._client_lock = threading.Lock()  # lookups run on several threads; boto3 client creation is not thread-safe

    def _s3(self):
        """The client, once the bucket is known to exist: a HEAD of a key in a missing bucket is a
        plain 404, which would make a misconfigured bucket look like a missing adapter."""
        with self._client_lock:
            if self._client is None:
                import boto3
                from botocore.config import Config
                from botocore.exceptions import BotoCoreError, ClientError

                # Short timeouts and few retries: a request waits on this lookup, and a store that
                # is down must cost it seconds, not minutes.
                config = Config(connect_timeout=2, read_timeout=30, retries={"max_attempts": 2})
                client = boto3.Session().client("s3", endpoint_url=self.endpoint_url, config=config)
                try:
                    client.head_bucket(Bucket=self.bucket)
                except (ClientError, BotoCoreError) as e:
                    raise AdapterSourceError(f"bucket {self.bucket!r}: {e}") from None
                self._client = client
            return self._client

    def _key(self, name: str, file: str) -> str:
        return "/".join(p for p in (self.prefix, name, file) if p)

    def resolve(self, name: str) -> str | None:
        if not is_resolvable_name(name):
            return None
        sizes = {}
        for file in SNAPSHOT_FILES:
            size = self._size(self._key(name, file))
            if size is None:
                return None
            if size > MAX_OBJECT_BYTES:
                raise AdapterValidationError(f"{file} is {size} bytes, more than {MAX_OBJECT_BYTES}")
            sizes[file] = size
        return str(self._download(name, sizes))

    def _size(self, key: str) -> int | None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return int(self._s3().head_object(Bucket=self.bucket, Key=key)["ContentLength"])
        except ClientError as e:
            # 403: with read but no list permission, S3 answers a missing key with 403, not 404.
            if e.response.get("Error", {}).get("Code") in ("403", "404", "NoSuchKey", "NotFound", "AccessDenied"):
                return None
            raise AdapterSourceError(f"s3://{self.bucket}/{key}: {e}") from None
        except BotoCoreError as e:
            raise AdapterSourceError(f"s3://{self.bucket}/{key}: {e}") from None

    def _download(self, name: str, sizes: dict[str, int]) -> Path:
        from botocore.exceptions import BotoCoreError, ClientError

        self.download_root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".download-", dir=self.download_root))
        try:
            for file, size in sizes.items():
                body = self._s3().get_object(Bucket=self.bucket, Key=self._key(name, file))["Body"]
                with open(staging / file, "wb") as out:
                    copied = _copy_at_most(body, out, size)
                if copied != size:
                    raise AdapterValidationError(f"{file} changed size while it was downloaded")
            final = self.download_root / download_dir_name(name)
            shutil.rmtree(final, ignore_errors=True)  # an earlier download of the same name
            staging.rename(final)
            return final
        except (ClientError, BotoCoreError) as e:
            raise AdapterSourceError(f"s3://{self.bucket}/{self._key(name, '')}: {e}") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _copy_at_most(body, out, limit: int) -> int:
    """Copy a streamed object, stopping one byte past `limit` (the caller compares the count)."""
    copied = 0
    while copied <= limit:
        chunk = body.read(min(1 << 20, limit + 1 - copied))
        if not chunk:
            break
        out.write(chunk)
        copied += len(chunk)
    return copied
