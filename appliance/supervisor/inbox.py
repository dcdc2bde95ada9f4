"""A runner's inbox: others post commands, the runner's own task carries them out.

The owner task never waits deaf. Every wait goes through :meth:`Inbox.busy` (await some
work) or :meth:`Inbox.nap` (wait for a while, or for a future), and both answer letters
as they arrive, from the owner's task, with the owner's ``obey`` function. So an admin's
drain is answered within moments even while the runner is in the middle of a ten-second
health check, and it is still the runner that changes the engine.

A command that should make the owner look again at once (a restart asked for, a reload)
calls :meth:`Inbox.wake`; the owner's next :meth:`nap` returns at once, as an
``asyncio.Event`` would, even if the command came while it was busy with something else.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from appliance.control import CommandResult
from appliance.supervisor.commands import Command

T = TypeVar("T")
_Letter = tuple[Command, "asyncio.Future[CommandResult] | None"]


class Inbox:
    def __init__(self, obey: Callable[[Command], CommandResult]) -> None:
        self._obey = obey
        self._queue: asyncio.Queue[_Letter] = asyncio.Queue()
        self._woken = False
        self._closed: Callable[[], CommandResult] | None = None

    # ---- the askers' side ---------------------------------------------------------------
    async def ask(self, command: Command) -> CommandResult:
        """Post ``command`` and wait for the owner's answer (the caller bounds the wait;
        a command whose asker stopped waiting is skipped, not carried out late)."""
        if self._closed is not None:
            return self._closed()
        reply: asyncio.Future[CommandResult] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((command, reply))
        return await reply

    def tell(self, command: Command) -> None:
        """Post ``command``, wanting no answer."""
        if self._closed is None:
            self._queue.put_nowait((command, None))

    # ---- the owner's side ---------------------------------------------------------------
    def wake(self) -> None:
        """Make the owner's next nap return at once (called from ``obey``)."""
        self._woken = True

    def clear(self) -> None:
        self._woken = False

    def close(self, answer: Callable[[], CommandResult]) -> None:
        """The owner stops: letters left, and later ones, get ``answer()``."""
        self._closed = answer
        while not self._queue.empty():
            _, reply = self._queue.get_nowait()
            if reply is not None and not reply.done():
                reply.set_result(answer())

    async def busy(self, work: Awaitable[T]) -> T:
        """``await work`` while answering letters: busy, never deaf."""
        task = asyncio.ensure_future(work)
        try:
            while not task.done():
                await self._answer_until({task}, None)
            return task.result()
        finally:
            task.cancel()  # a no-op unless the owner itself is being cancelled

    async def nap(self, timeout_s: float | None, *until: asyncio.Future[Any]) -> bool:
        """Answer letters for up to ``timeout_s`` (None: no limit) or until one of ``until``
        is done. True when a command woke the owner (now, or while it was busy before)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._woken:
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or any(f.done() for f in until):
                return False
            await self._answer_until(set(until), left)
        self._woken = False
        return True

    async def _answer_until(self, until: set[asyncio.Future[Any]], timeout_s: float | None) -> None:
        """Wait for the first of: a letter (answered here), one of ``until``, the timeout."""
        letter = asyncio.ensure_future(self._queue.get())
        try:
            await asyncio.wait(
                {letter, *until}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            letter.cancel()  # a letter not yet taken stays in the queue
        if letter.done() and not letter.cancelled():
            self._answer(*letter.result())

    def _answer(self, command: Command, reply: asyncio.Future[CommandResult] | None) -> None:
        if reply is not None and reply.done():
            return  # its asker stopped waiting: a late drain must not surprise anyone
        result = self._obey(command)
        if reply is not None:
            reply.set_result(result)
