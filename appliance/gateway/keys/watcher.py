"""Hot reload: the daemon puts a changed keys file in force without a restart.

The watcher polls the file's signature (mtime, size, inode) and swaps the keys in force
when it changes, and at once on SIGHUP (``reload_now``). A corrupt file never replaces
good keys: the last good ones stay in force and the problem is logged once per distinct
content. A keys file that is *removed* means no keys (fail closed); ``serve`` makes a
fresh admin key on its next start.

With no good keys to keep (a file corrupt or unreadable at start, ``first_load``, or
after the file was removed) a bad file leaves the store refusing every key
(:meth:`KeyStore.refuse_all`: 503 ``keys_file_error``, ``/readyz`` 503) instead of
stopping the daemon, which systemd would only restart into the same file in a loop.
The next poll that finds the file fixed puts it in force: no restart needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from collections.abc import Callable

from appliance.gateway.keys.errors import KeysFileError
from appliance.gateway.keys.store import KeyStore, Signature

# One logger for the whole package: log lines keep the name they had as one module.
log = logging.getLogger("appliance.gateway.keys")


class KeyWatcher:
    """Polls the keys file and puts its keys in force when it changes; ``reload_now`` for
    SIGHUP. A corrupt or unreadable file keeps the last good keys and is logged once per
    distinct content. Never raises out of its loop."""

    def __init__(
        self,
        store: KeyStore,
        interval_s: float = 1.0,
        logger: logging.Logger | None = None,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store
        # Called in the loop after other keys were put in force (the open requests of a
        # key no longer valid are ended: gateway/open_requests.py).
        self.on_change = on_change
        self.interval_s = interval_s
        self.log = logger or log
        self._seen: Signature | None = store.signature
        self._reported: object = None  # the problem last logged, to log each one once
        self._task: asyncio.Task[None] | None = None

    def _stat(self) -> Signature | None:
        try:
            st = os.stat(self.store.path)
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _report(self, problem: object, message: str) -> None:
        # With no key in force there are no "last good keys" to keep: every key is
        # refused as unverifiable (503) until the file is fixed, rather than as unknown.
        refusing = not self.store.records
        if refusing:
            self.store.refuse_all(message)
        if problem != self._reported:
            self._reported = problem
            if refusing:
                self.log.error(
                    "%s; no key is in force: every request with a key gets 503 "
                    "keys_file_error until the file is fixed (fix or restore it, or move "
                    "it away and run `llm-appliance keys create --name admin --scope admin`; "
                    "picked up within 2 s, no restart needed)",
                    message,
                )
            else:
                self.log.error("%s; the last good keys stay in force", message)

    def first_load(self) -> bool:
        """The daemon's first read of the file, before it serves. True when its keys (or
        none: no file) are in force. False when it cannot be read or parsed: the daemon
        still starts, refusing every key (``store.problem``), the journal says what and
        where, and the watcher puts the file in force once it is fixed."""
        return self.poll(force=True)

    def refuse_all(self, message: str) -> None:
        """The keys file cannot be used although it read fine (the first admin key could
        not be written): refuse every key as :meth:`first_load` does, logged once."""
        self._report(("refused", message), message)

    def poll(self, force: bool = False) -> bool:
        """One check. True when the keys in force are the file's; False when the file is
        bad (the last good keys stay in force)."""
        try:
            current = self._stat()
        except OSError as exc:
            self._report(
                ("stat", str(exc)),
                f"keys file {self.store.path} is invalid (cannot stat: {exc.strerror or exc})",
            )
            return False
        if not force and current == self._seen and self._reported is None:
            return True
        if not force and current == self._seen:
            return False  # unchanged and still bad; already reported
        self._seen = current
        try:
            data, signature = self.store.read()
        except KeysFileError as exc:
            self._report(("read", str(exc)), f"keys file {self.store.path} is invalid ({exc})")
            return False
        if data is None:
            self._forget_all()
            return True
        return self._put_in_force(data, signature, force)

    def _forget_all(self) -> None:
        """The file is gone: no key is accepted (fail closed)."""
        had = len(self.store.records)
        self.store.apply(None, None)
        self.on_change()
        if had or self._reported is not None:
            self.log.warning(
                "keys file %s is gone: no key is accepted until it is back "
                "(a restart creates a new admin key)",
                self.store.path,
            )
        self._reported = None

    def _put_in_force(self, data: bytes, signature: Signature | None, force: bool) -> bool:
        """The file's new content: in force when it parses, else reported (once)."""
        digest = hashlib.sha256(data).hexdigest()
        if digest == self.store.digest and not force:
            self._reported = None
            return True
        try:
            self.store.apply(data, signature)
        except KeysFileError as exc:
            self._report(digest, f"keys file {self.store.path} is invalid ({exc})")
            return False
        self._reported = None
        self.on_change()
        self.log.info(
            "keys file %s reloaded: %d key(s) in force", self.store.path, len(self.store.records)
        )
        return True

    def reload_now(self) -> bool:
        """Re-read the file now (SIGHUP). True when its keys are in force."""
        try:
            return self.poll(force=True)
        except Exception:  # pragma: no cover - a bug; a reload must not kill the caller
            self.log.exception("reloading keys file %s failed", self.store.path)
            return False

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.poll()
            except Exception:  # pragma: no cover - a bug; keep watching regardless
                self.log.exception("checking keys file %s failed", self.store.path)

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._seen = self.store.signature
            self._task = asyncio.get_running_loop().create_task(self._run(), name="keys-watcher")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
