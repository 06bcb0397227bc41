"""Load-before-swap reloads of a serving app (POST /v1/admin/reload), and the admin token they need.

    $ curl -s -X POST localhost:8080/v1/admin/reload -H "Authorization: Bearer $TOKEN" -d '{"path": "snapshots/v2"}'

The new snapshot is loaded, verified and smoke-tested off the event loop (one reload thread); only
then does it become the version new requests are validated on. Anything that fails refuses the
snapshot and the old version keeps serving. In-flight requests finish on the version they were
validated on (their group key holds it). Reloads run one at a time.

With several server processes (`silverrec serve --workers N`, serving/processes.py) a reload that
reaches one of them is coordinated across all: every process loads the snapshot (`prepare`), and
only when all have does every one switch (`commit`); any refusal leaves every process on its old
version (`abort`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import os
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Optional

from silverrec.errors import SilverrecError, SnapshotError
from silverrec.serving.metrics import Metrics
from silverrec.serving.served import Served

TOKEN_ENV = "SILVERREC_ADMIN_TOKEN"


def read_token(token_file: Optional[str] = None) -> Optional[str]:
    """Admin token: the file's first line if given, else $SILVERREC_ADMIN_TOKEN; None if neither."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as e:
            raise SilverrecError(f"cannot read admin token file {token_file}: {e}") from None
        if not token:
            raise SilverrecError(f"admin token file {token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def admin_refusal(headers: Mapping[str, str], token: Optional[str]) -> Optional[tuple[int, str]]:
    """(status, message) when a reload request may not proceed: 403 reloads disabled (no token
    configured), 401 wrong or missing token (Authorization: Bearer or X-Admin-Token); None = allowed."""
    if not token:
        return 403, f"reload is disabled: start the server with ${TOKEN_ENV} or --admin-token-file"
    auth = headers.get("authorization", "")
    given = auth[7:] if auth.lower().startswith("bearer ") else headers.get("x-admin-token", "")
    if not hmac.compare_digest(given.encode(), token.encode()):
        return 401, "reload needs the admin token (Authorization: Bearer TOKEN)"
    return None


class Reloader:
    """The served version of one app and its replacement.

    `current` is the version new requests are validated on; `loader(path) -> Served` loads, verifies
    and smoke-tests a snapshot (the app's default: `served.load_served` on its device).
    `coordinator(path) -> awaitable answer`, where given, runs every reload across the server's
    processes (serving/processes.py), which call `prepare`, `commit` and `abort` here."""

    def __init__(self, path: str | os.PathLike, loader: Callable[[Path], Served], metrics: Metrics,
                 served: Optional[Served] = None,
                 coordinator: Optional[Callable[[Optional[str]], Awaitable[dict[str, Any]]]] = None):
        self.path = Path(path)
        self.loader = loader
        self.metrics = metrics
        self.coordinator = coordinator
        self.current = served if served is not None else loader(self.path)
        metrics.serving(self.current.version, self.current.kind)
        self._lock = asyncio.Lock()
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._pending: Optional[tuple[Served, Path]] = None

    def start(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="silverrec-reload")

    def stop(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    async def reload(self, path: Optional[str]) -> dict[str, Any]:
        """Load `path` (default: the served path again), then switch -> {version, previous, kind, path}.

        Raises:
            SnapshotError: the snapshot was refused (the message names why); the old one still serves.
        """
        if self.coordinator is not None:
            return await self.coordinator(path)
        async with self._lock:
            await asyncio.get_running_loop().run_in_executor(self._pool, self.prepare, path)
            return self.commit()

    def prepare(self, path: Optional[str]) -> str:
        """Load, verify and smoke-test `path` (default: the served path) beside the current version, in
        the caller's thread -> its version; nothing switches yet.

        Raises:
            SnapshotError: refused (the message names the snapshot, the version still served and why).
        """
        target = Path(path) if path else self.path
        try:
            new = self.loader(target)
        except Exception as e:  # noqa: BLE001  (any failure refuses the snapshot)
            self.metrics.reloads.labels("refused").inc()
            raise SnapshotError(f"snapshot {target} refused, still serving {self.current.version}: "
                                f"{type(e).__name__}: {e}") from None
        self._pending = (new, target)
        return new.version

    def commit(self) -> dict[str, Any]:
        """Switch to the prepared version -> {version, previous, kind, path}."""
        (new, target), old = self._pending, self.current
        self._pending = None
        self.current, self.path = new, target
        self.metrics.serving(new.version, new.kind)
        self.metrics.reloads.labels("ok").inc()
        return {"version": new.version, "previous": old.version, "kind": new.kind, "path": str(target)}

    def abort(self) -> None:
        """Drop the prepared version (another process refused it)."""
        self._pending = None
