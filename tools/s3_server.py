"""The local stack's S3: moto's S3 server over HTTP, written through to a folder.

    python tools/s3_server.py --host 127.0.0.1 --port 9000 --data .scratch/s3-data

moto keeps objects in memory only. Here every request that may change a bucket (PUT, POST, DELETE) is
written to --data before its response leaves: the buckets are compared with the folder and each object
that appeared or changed is written (its bytes, then a small JSON of its key, ETag, content type and data
file that vouches for them; each to a temp file, fsynced, then renamed), each one gone is removed. Only
then is the change committed: the client hears success, and the index of what is on disk moves on. A
write that fails (a full disk, a read-only folder) answers 500 InternalError and puts moto back to what
the folder holds, so nothing is listable or readable that is not on disk; requests that change a bucket
run one at a time, and reads wait while one is being committed. At start the folder is loaded back,
ETags included, so what a manifest recorded still matches. An object a client was told is stored
therefore survives the emulator being killed, `kill -9` included, and a power cut. MinIO (docker/) is
the store to use beyond one machine.

Only the standard library and moto (the dev extra) are imported.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import threading
from pathlib import Path
from xml.sax.saxutils import escape

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
    """`data` at `path`, all or nothing: a temp file beside it, fsynced, renamed over it, the folder fsynced
    (so the rename itself survives a power cut)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Gate:
    """Many readers or one writer: a change and its commit to disk happen while no request reads moto, so no
    one lists an object that a failed write is about to take back."""

    def __init__(self):
        self.cond = threading.Condition()
        self.readers = 0
        self.writing = False

    @contextlib.contextmanager
    def shared(self):
        with self.cond:
            self.cond.wait_for(lambda: not self.writing)
            self.readers += 1
        try:
            yield
        finally:
            with self.cond:
                self.readers -= 1
                self.cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        with self.cond:
            self.cond.wait_for(lambda: not self.writing)
            self.writing = True  # new readers wait from here on
            self.cond.wait_for(lambda: self.readers == 0)
        try:
            yield
        finally:
            with self.cond:
                self.writing = False
                self.cond.notify_all()


class Store:
    """The folder: <data>/<bucket>/<sha256 of key>.json naming its bytes' file (<sha256 of key>.<etag>.data);
    ``index`` is {bucket: {key: etag}} of what is on disk."""

    def __init__(self, root: Path):
        self.root = root
        self.lock = threading.Lock()
        self.index: dict[str, dict[str, str]] = {}

    def _path(self, bucket: str, key: str) -> Path:
        return self.root / bucket / hashlib.sha256(key.encode()).hexdigest()

    @staticmethod
    def _data_path(meta_path: Path, meta: dict) -> Path:
        # A folder written before the data file's name was recorded holds <sha>.data.
        return meta_path.with_name(meta["data"]) if meta.get("data") else meta_path.with_suffix(".data")

    def _read(self, bucket: str, key: str) -> tuple[dict, bytes]:
        """The metadata and bytes the folder holds for one object."""
        meta_path = self._path(bucket, key).with_suffix(".json")
        meta = json.loads(meta_path.read_text())
        return meta, self._data_path(meta_path, meta).read_bytes()

    @staticmethod
    def _put(bucket: str, meta: dict, data: bytes) -> None:
        """One object into moto as the folder holds it, ETag and content type included."""
        key = _backend().put_object(bucket, meta["key"], data, etag=meta["etag"].strip('"'))
        if meta.get("content_type"):
            key.set_metadata({"Content-Type": meta["content_type"]})

    def load(self) -> tuple[int, int]:
        """Put the folder's buckets and objects into moto; returns (objects, bytes)."""
        self.root.mkdir(parents=True, exist_ok=True)
        objects = size = 0
        for folder in sorted(p for p in self.root.iterdir() if p.is_dir()):
            _backend().create_bucket(folder.name, REGION)
            keys = self.index.setdefault(folder.name, {})
            for meta_path in sorted(folder.glob("*.json")):
                meta = json.loads(meta_path.read_text())
                data = self._data_path(meta_path, meta).read_bytes()
                self._put(folder.name, meta, data)
                keys[meta["key"]] = meta["etag"]
                objects, size = objects + 1, size + len(data)
        return objects, size

    def _write_object(self, bucket: str, key_name: str, key) -> None:
        """The object's bytes, then its metadata (which names them and so vouches for them), then the old bytes go.
        A failure leaves the previous version whole: its metadata and bytes are untouched until the new ones are in."""
        path = self._path(bucket, key_name)
        meta_path = path.with_suffix(".json")
        old = json.loads(meta_path.read_text()) if meta_path.exists() else None
        data_path = path.with_name(f"{path.name}.{hashlib.sha256(key.etag.encode()).hexdigest()[:16]}.data")
        meta = {
            "key": key_name,
            "etag": key.etag,
            "content_type": key.metadata.get("Content-Type"),
            "data": data_path.name,
        }
        try:
            _write(data_path, key.value)
            _write(meta_path, json.dumps(meta).encode())
        except BaseException:
            if old is None or self._data_path(meta_path, old) != data_path:
                data_path.unlink(missing_ok=True)  # bytes no metadata names
            raise
        if old is not None and self._data_path(meta_path, old) != data_path:
            self._data_path(meta_path, old).unlink(missing_ok=True)

    def _remove_object(self, bucket: str, key_name: str) -> None:
        meta_path = self._path(bucket, key_name).with_suffix(".json")
        if meta_path.exists():
            data_path = self._data_path(meta_path, json.loads(meta_path.read_text()))
            meta_path.unlink()  # the metadata first: it names the object
            data_path.unlink(missing_ok=True)

    def sync(self) -> None:
        """Make the folder what moto holds now (only what differs is written); the index follows each success."""
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
                    self._remove_object(name, key_name)
                    del stored[key_name]
                for key_name, key in now.items():
                    if stored.get(key_name) != key.etag:
                        self._write_object(name, key_name, key)
                        stored[key_name] = key.etag  # committed: on disk

    def rollback(self) -> None:
        """Make moto what the folder holds (the index): after a write that failed, what it did not commit goes."""
        with self.lock:
            backend, buckets = _backend(), _buckets()
            for name, bucket in buckets.items():
                stored = self.index.get(name, {})
                now = {key_name: key.etag for key_name, key in bucket.keys.items() if hasattr(key, "etag")}
                for key_name, etag in now.items():
                    if stored.get(key_name) != etag:
                        backend.delete_object(name, key_name, bypass=True)
                for key_name, etag in stored.items():
                    if now.get(key_name) != etag:
                        self._put(name, *self._read(name, key_name))
                if name not in self.index:
                    backend.delete_bucket(name)
            for name, stored in self.index.items():
                if name not in buckets:  # a bucket removed in moto whose folder is still there
                    backend.create_bucket(name, REGION)
                    for key_name in stored:
                        self._put(name, *self._read(name, key_name))


def _internal_error(path: str, error: BaseException) -> tuple[str, list, bytes]:
    """S3's answer to a write it could not store: 500 InternalError (clients retry it) naming the cause."""
    message = escape(f"the emulator could not write this change to its folder: {type(error).__name__}: {error}")
    body = f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code><Message>{message}</Message><Resource>{escape(path)}</Resource></Error>'
    return "500 Internal Server Error", [("Content-Type", "application/xml")], body.encode()


class WriteThrough:
    """WSGI middleware: a request that may change a bucket runs alone, is synced to the folder, and only then
    answered; one whose sync fails is undone in moto and answered 500. Reads run together, between changes."""

    def __init__(self, app, store: Store):
        self.app, self.store = app, store
        self.gate = Gate()

    def __call__(self, environ, start_response):
        if environ.get("PATH_INFO", "").startswith("/moto-api"):
            return self.app(environ, start_response)
        if environ.get("REQUEST_METHOD") not in CHANGING:
            with self.gate.shared():
                return [b"".join(self.app(environ, start_response))]
        answer: list = []
        with self.gate.exclusive():
            # moto's status and headers are held back: the client must not hear "stored" before the sync.
            body = b"".join(self.app(environ, lambda status, headers, exc_info=None: answer.extend([status, headers])))
            try:
                self.store.sync()
            except Exception as error:  # a full disk, a read-only folder, …: undo it, so nothing unstored is listed
                print(
                    f"s3: cannot store {environ.get('REQUEST_METHOD')} {environ.get('PATH_INFO')}: {error}; undone",
                    file=sys.stderr,
                    flush=True,
                )
                try:
                    self.store.rollback()
                except Exception as undo:  # the folder could not even be read back: say so, still answer 500
                    print(f"s3: cannot undo it from {self.store.root}: {undo}", file=sys.stderr, flush=True)
                status, headers, body = _internal_error(environ.get("PATH_INFO", ""), error)
                answer[:] = [status, headers]
        start_response(answer[0], answer[1])
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
