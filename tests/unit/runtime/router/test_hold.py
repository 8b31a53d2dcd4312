"""The bounded FIFO of held requests (kvfleet.runtime.router.hold): order, bound, timeout."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet.runtime.router.hold import PendingQueue, PendingTimeout, QueueClosed, QueueFull


def test_hold_queue_fifo_bound_and_timeout():
    async def main():
        q = PendingQueue(max_pending=2, pending_timeout=0.3)
        up = False
        order = []

        async def one(i):
            await q.hold(lambda: up)
            order.append(i)

        tasks = [asyncio.create_task(one(i)) for i in range(2)]
        await asyncio.sleep(0.01)
        assert len(q) == 2
        with pytest.raises(QueueFull):
            await q.hold(lambda: up)
        up = True
        q.notify()
        await asyncio.gather(*tasks)
        assert order == [0, 1] and len(q) == 0
        up = False
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(PendingTimeout):
            await q.hold(lambda: up)
        # at its timeout, not before; the upper bound only says "not hung": a loaded machine may
        # wake the loop late (an upper bound of 1 s would be a timing assumption, not the contract)
        assert 0.25 < asyncio.get_running_loop().time() - t0 < 30
        # woken while nothing is available after all: it keeps waiting at the head (with a timeout
        # that a descheduled loop cannot reach between the steps below)
        q.pending_timeout = 30
        late = asyncio.create_task(q.hold(lambda: up))
        await asyncio.sleep(0.01)
        q.notify()
        await asyncio.sleep(0.01)
        assert not late.done() and len(q) == 1
        up = True
        q.notify()
        await late

    asyncio.run(main())


def test_close_releases_every_held_request_and_holds_nothing_more():
    async def main():
        q = PendingQueue(max_pending=4, pending_timeout=30)
        held = [asyncio.create_task(q.hold(lambda: False)) for _ in range(2)]
        await asyncio.sleep(0.01)
        assert len(q) == 2
        q.close()
        for t in held:
            with pytest.raises(QueueClosed):
                await t
        assert len(q) == 0
        with pytest.raises(QueueClosed):
            await q.hold(lambda: False)

    asyncio.run(main())
