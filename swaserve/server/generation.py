"""Generation: the event-loop side of one HTTP request (its prompts x n engine requests and their updates)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from swaserve.server.messages import SubRequest, Update


class Generation:
    """The event-loop side of one HTTP request: its sub-requests (prompts x n) and their updates.

    `start()` waits until the engine accepted every sub-request (raising the first refusal as an
    APIError); `updates()` yields batches until every sub-request finished. `close()` aborts whatever
    has not finished; call it in a `finally` so a vanished client frees its memory.
    """

    def __init__(self, subs: list[SubRequest], abort: Callable[[str], None]):
        self._abort = abort
        self.queue: asyncio.Queue[list[Update]] = asyncio.Queue()
        self._open = {s.index: s.request_id for s in subs}
        self._early: list[Update] = []
        self.prompt_tokens: dict[int, int] = {}

    async def start(self) -> None:
        try:
            while len(self.prompt_tokens) < len(self._open):
                for upd in await self.queue.get():
                    if upd.error is not None:
                        self._open.pop(upd.index, None)
                        raise upd.error
                    if upd.accepted:
                        self.prompt_tokens[upd.index] = upd.prompt_tokens
                    else:
                        self._early.append(upd)
        except BaseException:
            self.close()
            raise

    async def updates(self) -> AsyncIterator[list[Update]]:
        pending, self._early = self._early, []
        while True:
            for upd in pending:
                if upd.error is not None:
                    self._open.pop(upd.index, None)
                    raise upd.error
                if upd.finish_reason is not None:
                    self._open.pop(upd.index, None)
            if pending:
                yield pending
            if not self._open:
                return
            pending = await self.queue.get()
            while not self.queue.empty():  # coalesce: a slow consumer gets fewer, larger batches
                pending = pending + self.queue.get_nowait()

    def close(self) -> None:
        open_ids, self._open = list(self._open.values()), {}
        for request_id in open_ids:
            self._abort(request_id)
