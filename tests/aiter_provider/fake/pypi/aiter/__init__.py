"""Stand-in for the unrelated PyPI package ``aiter`` (richardkiss/aiter, "useful patterns building
upon asynchronous iterators"): same import name, none of AMD aiter's API."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any


async def azip(*iterators: AsyncIterator[Any]) -> AsyncIterator[tuple[Any, ...]]:
    while True:
        try:
            yield tuple([await it.__anext__() for it in iterators])
        except StopAsyncIteration:
            return


async def join_aiters(*iterators: AsyncIterator[Any]) -> AsyncIterator[Any]:
    for it in iterators:
        async for item in it:
            yield item


async def map_aiter(fn: Callable[[Any], Awaitable[Any]], iterator: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for item in iterator:
        yield await fn(item)
