"""The local stack's S3: moto's S3 server over HTTP, written through to a folder.

    python tools/s3_server.py --host 127.0.0.1 --port 9000 --data .scratch/s3-data

moto keeps objects in memory only. Here every request that may change a bucket (PUT, POST, DELETE) is
written to --data before its response leaves: the buckets are compared with the folder and each object
that appeared or changed is written (its bytes and a small JSON of its key, ETag and content type, each
replaced atomically), each one gone is removed. At start the folder is loaded back, ETags included, so
what a manifest recorded still matches. An object a client was told is stored therefore survives the
emulator being killed, `kill -9` included (not a power cut: nothing is fsynced). MinIO (docker/) is the
store to use beyond one machine.

Only the standard library and moto (the dev extra) are imported.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
from pathlib import Path

from moto.core import DEFAULT_ACCOUNT_ID
from moto.s3.models import s3_backends
from moto.server import DomainDispatcherApplication, create_backend_app

REGION = "us-east-1"
CHANGING = ("PUT", "POST", "DELETE")


def _backend(account: str = DEFAULT_ACCOUNT_ID):
    return s3_backends[account]["global"]


def _buckets() -> dict:
    """{bucket name: moto's bucket} over every account."""
    return {name: _backend(account).get_bucket(name) for name, account in list(s3_backends.bucket_accounts.items())}


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class Store:
    """The folder: <data>/<bucket>/<sha256 of key>.{data,json}; ``index`` is {bucket: {key: etag}} of it."""

    def __init__(self, root: Path):
        self.root = root
        self.lock = threading.Lock()
        self.index: dict[str, dict[str, str]] = {}

    def _path(self, bucket: str, key: str) -> Path:
        return self.root / bucket / hashlib.sha256(key.encode()).hexdigest()

    def load(self) -> tuple[int, int]:
        """Put the folder's buckets and objects into moto; returns (objects, bytes)."""
        self.root.mkdir(parents=True, exist_ok=True)
        objects = size = 0
        for folder in sorted(p for p in self.root.iterdir() if p.is_dir()):
            backend = _backend()
            backend.create_bucket(folder.name, REGION)
            keys = self.index.setdefault(folder.name, {})
            for meta_path in sorted(folder.glob("*.json")):
                meta = json.loads(meta_path.read_text())
                data = meta_path.with_suffix(".data").read_bytes()
                key = backend.put_object(folder.name, meta["key"], data, etag=meta["etag"].strip('"'))
                if meta.get("content_type"):
                    key.set_metadata({"Content-Type": meta["content_type"]})
                keys[meta["key"]] = meta["etag"]
                objects, size = objects + 1, size + len(data)
        return objects, size

    def sync(self) -> None:
        """Make the folder what moto holds now (only what differs is written)."""
        with self.lock:
            buckets = _buckets()
            for name in set(self.index) - set(buckets):
                for path in (self.root / name).glob("*"):
                    path.unlink()
                (self.root / name).rmdir()
                del self.index[name]
            for name, bucket in buckets.items():
                (self.root / name).mkdir(parents=True, exist_ok=True)
                stored = self.index.setdefault(name, {})
                now = {key_name: key for key_name, key in bucket.keys.items() if hasattr(key, "etag")}
                for key_name in set(stored) - set(now):
                    path = self._path(name, key_name)
                    path.with_suffix(".json").unlink(missing_ok=True)  # the metadata first: it names the object
                    path.with_suffix(".data").unlink(missing_ok=True)
                    del stored[key_name]
                for key_name, key in now.items():
                    if stored.get(key_name) == key.etag:
                        continue
                    path = self._path(name, key_name)
                    _write(path.with_suffix(".data"), key.value)
                    meta = {"key": key_name, "etag": key.etag, "content_type": key.metadata.get("Content-Type")}
                    _write(path.with_suffix(".json"), json.dumps(meta).encode())  # last: vouches for the bytes
                    stored[key_name] = key.etag


class WriteThrough:
    """WSGI middleware: after a request that may change a bucket, sync the folder, then answer."""

    def __init__(self, app, store: Store):
        self.app, self.store = app, store

    def __call__(self, environ, start_response):
        if environ.get("REQUEST_METHOD") not in CHANGING or environ.get("PATH_INFO", "").startswith("/moto-api"):
            return self.app(environ, start_response)
        # The server sends nothing before the body is returned, so the client hears "stored" only after the sync.
        body = b"".join(self.app(environ, start_response))
        self.store.sync()
        return [body]


def main(argv: list[str] | None = None) -> None:
    from werkzeug.serving import run_simple

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--data", type=Path, required=True, help="the folder objects are written through to")
    args = parser.parse_args(argv)
    os.environ.setdefault("MOTO_PORT", str(args.port))
    store = Store(args.data.resolve())
    objects, size = store.load()
    print(f"s3: loaded {objects} objects ({size} bytes) from {store.root}", file=sys.stderr, flush=True)
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(args.host, args.port, WriteThrough(app, store), threaded=True)


if __name__ == "__main__":
    main()
