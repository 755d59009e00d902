"""The asyncio client: the synchronous client's calls as coroutines, concurrent on one channel,
with the same results and the same typed errors, against a real in-process service."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from kvstore.client.async_client import AsyncKvstoreClient
from kvstore.client.sync_client import InvalidArgumentError, KvstoreClient
from tests.fixtures.service import CHUNK, TOY, Service, payloads, tokens


def test_calls_overlap_and_answer_as_the_synchronous_client_does(service: Service) -> None:
    cb = service.chunk_bytes(TOY)
    prompts = [tokens(80 + i, 3 * CHUNK) for i in range(4)]

    async def run() -> None:
        async with AsyncKvstoreClient(service.address, timeout_seconds=20.0) as kv:
            await kv.wait_ready(10.0)
            stored = await asyncio.gather(*(kv.store(TOY, p, payloads(80 + i, 3, cb)) for i, p in enumerate(prompts)))
            assert [s.stored_chunks for s in stored] == [3, 3, 3, 3]
            looked = await asyncio.gather(*(kv.lookup(TOY, p) for p in prompts))
            assert [r.hit_chunks for r in looked] == [3, 3, 3, 3]
            loaded = await kv.load(TOY, prompts[2])
            assert [bytes(c) for c in loaded.chunks] == payloads(82, 3, cb)
            resumed = await kv.resume(TOY, prompts[1])
            assert resumed.hit_tokens == 3 * CHUNK and resumed.case in ("warm", "expired")
            assert (await kv.stats()).chunks >= 12
            with pytest.raises(InvalidArgumentError, match="model"):
                await kv.lookup("no-such-model", prompts[0])

    asyncio.run(run())
    sync = service.client()
    assert sync.lookup(TOY, prompts[3]).hit_chunks == 3


def test_every_call_of_the_synchronous_client_but_the_generator_has_a_coroutine_form() -> None:
    calls = {n for n, f in vars(KvstoreClient).items() if inspect.isfunction(f) and not n.startswith("_")}
    # close is a coroutine of its own; a generator has no coroutine form; load_shared and
    # read_held are async `with`s
    calls -= {"close", "iter_load", "load_shared", "read_held"}
    for name in calls:
        assert inspect.iscoroutinefunction(getattr(AsyncKvstoreClient, name, None)), name
    assert inspect.isasyncgenfunction(inspect.unwrap(AsyncKvstoreClient.load_shared))
    assert inspect.isasyncgenfunction(inspect.unwrap(AsyncKvstoreClient.read_held))


def test_load_shared_as_an_async_context_manager(service: Service) -> None:
    cb = service.chunk_bytes(TOY)
    prompt = tokens(91, 2 * CHUNK)
    service.client().store(TOY, prompt, payloads(91, 2, cb))

    async def run() -> list[bytes]:
        async with AsyncKvstoreClient(service.address) as kv, kv.load_shared(TOY, prompt) as got:
            return [bytes(c) for c in got.chunks]

    assert asyncio.run(run()) == payloads(91, 2, cb)


def test_load_into_as_a_coroutine_writes_into_the_callers_buffer(service: Service) -> None:
    cb = service.chunk_bytes(TOY)
    prompt = tokens(90, 2 * CHUNK)
    service.client().store(TOY, prompt, payloads(90, 2, cb))
    buf = bytearray(2 * cb)

    async def run() -> int:
        async with AsyncKvstoreClient(service.address, timeout_seconds=20.0) as kv:
            return (await kv.load_into(TOY, prompt, buf)).loaded_chunks

    assert asyncio.run(run()) == 2
    assert bytes(buf) == b"".join(payloads(90, 2, cb))
