"""The asyncio face shares the core with the thread face and never blocks the event loop."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest

from relax_queue import AsyncTransferQueue, QueueFullError, QueueTimeoutError, RowInput, TransferQueue

MakeQueue = Callable[..., TransferQueue]


def test_async_get_wakes_on_thread_put_while_loop_stays_responsive(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",))
    aq = AsyncTransferQueue(q)

    async def main() -> tuple[list[object], int]:
        ticks = 0

        async def ticker() -> None:
            # Only a loop that keeps running while get waits reaches the fifth tick, and only then do the rows
            # arrive (from another thread): a get that blocked the loop would never see them and time out.
            nonlocal ticks
            while True:
                ticks += 1
                if ticks == 5:
                    threading.Thread(target=q.put_many, args=([RowInput(i, {"x": i}) for i in range(3)],)).start()
                await asyncio.sleep(0.005)

        tick_task = asyncio.create_task(ticker())
        batch = await aq.reader("a", ["x"]).get(3, timeout=60)
        aq.ack(batch)
        tick_task.cancel()
        return batch.keys, ticks

    keys, ticks = asyncio.run(main())
    assert keys == [0, 1, 2]
    assert ticks >= 5  # the loop kept running while get waited
    assert len(q) == 0


def test_async_put_backpressure_and_timeouts(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",), max_rows=1, lease_timeout_s=0.05)
    aq = AsyncTransferQueue(q)

    # The timeouts of waits that must succeed are bounds only (a loaded machine can stall a thread for seconds:
    # 1 s once ran out before the get below had acked); the ones that must expire stay short.
    async def main() -> None:
        await aq.put("k0", {"x": 0})
        with pytest.raises(QueueFullError):
            await aq.put("k1", {"x": 1}, timeout=0.02)
        reader = aq.reader("a")
        put_task = asyncio.create_task(aq.put("k1", {"x": 1}, timeout=60))
        await asyncio.sleep(0.02)
        assert not put_task.done()
        reader.ack(await reader.get(1, timeout=60))
        await put_task
        leased = await reader.get(1, timeout=60)
        again = await reader.get(1, timeout=60)  # redelivered when the lease expires
        assert again.keys == leased.keys == ["k1"]
        with pytest.raises(QueueTimeoutError):
            await aq.reader("a").get(2, timeout=0.01)
        # The get acks k1 before it waits, which frees the room the next put needs.
        get_task = asyncio.create_task(reader.get_columns(1, timeout=60, ack=again))
        await aq.put("k2", {"x": 2}, timeout=60)
        assert (await get_task).keys == ["k2"] and q.metrics()["tasks"]["a"]["acked"] == 2

    asyncio.run(main())


def test_async_admit_waits_for_version(make_queue: MakeQueue) -> None:
    from relax_queue import TaskSpec

    q = make_queue(tasks=(TaskSpec("t", check_staleness=True),), tau=0, batch_size=1)
    aq = AsyncTransferQueue(q)

    async def main() -> tuple[int, int, float]:
        first = await aq.admit(5)
        start = time.monotonic()
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, q.publish_version, 1)
        second = await aq.admit(5, timeout=2)
        return first, second, time.monotonic() - start

    first, second, waited = asyncio.run(main())
    assert (first, second) == (1, 1)
    assert waited >= 0.04
