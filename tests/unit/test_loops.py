from __future__ import annotations

import asyncio
import os
import threading

import pytest

from carryover.state.loops import Deadline, RunningLoop


def test_running_loop_is_the_running_one_across_runs_and_threads() -> None:
    running = RunningLoop()

    async def both() -> tuple[asyncio.AbstractEventLoop, asyncio.AbstractEventLoop]:
        return running(), asyncio.get_running_loop()

    for _ in range(2):  # a second asyncio.run brings a new loop
        found, actual = asyncio.run(both())
        assert found is actual
    seen: list[bool] = []

    def other_thread() -> None:
        found, actual = asyncio.run(both())
        seen.append(found is actual)

    outer_loop = asyncio.new_event_loop()
    try:

        async def while_another_thread_runs_its_own() -> None:
            assert running() is asyncio.get_running_loop()
            thread = threading.Thread(target=other_thread)
            thread.start()
            await asyncio.to_thread(thread.join)
            assert running() is asyncio.get_running_loop()

        outer_loop.run_until_complete(while_another_thread_runs_its_own())
    finally:
        outer_loop.close()
    assert seen == [True]


def test_running_loop_asks_asyncio_once_per_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    running = RunningLoop()
    asked: list[int] = []
    real = asyncio.get_running_loop

    def counted() -> asyncio.AbstractEventLoop:
        asked.append(1)
        return real()

    monkeypatch.setattr(asyncio, "get_running_loop", counted)

    async def many() -> None:
        for _ in range(100):
            running()

    asyncio.run(many())
    assert len(asked) == 1


def test_running_loop_in_a_child_forked_while_the_loop_runs() -> None:
    running = RunningLoop()

    async def fork_and_check() -> int:
        parent_loop = running()
        pid = os.fork()
        if pid == 0:  # the child: the parent's loop object looks as if it ran here
            code = 1
            try:

                async def child() -> bool:
                    found = running()
                    return found is asyncio.get_running_loop() and found is not parent_loop

                code = 0 if asyncio.new_event_loop().run_until_complete(child()) else 1
            finally:
                os._exit(code)
        _, status = await asyncio.to_thread(os.waitpid, pid, 0)
        return os.waitstatus_to_exitcode(status)

    assert asyncio.run(fork_and_check()) == 0


def test_deadline_turns_its_own_cancel_into_a_timeout() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        never: asyncio.Future[None] = loop.create_future()
        started = loop.time()
        with pytest.raises(TimeoutError):
            async with Deadline(loop, 0.05):
                await never
        assert loop.time() - started >= 0.05
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0  # its cancel was taken back

    asyncio.run(main())


def test_deadline_met_leaves_nothing_behind() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        answered = loop.create_future()
        loop.call_soon(answered.set_result, None)
        async with Deadline(loop, 0.05):
            await answered
        # Past the deadline, the task is not cancelled by a timer left running.
        done = loop.create_future()
        loop.call_later(0.1, done.set_result, None)
        await done

    asyncio.run(main())


def test_deadline_lets_a_cancel_from_elsewhere_through() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        entered = asyncio.Event()

        async def guarded() -> None:
            async with Deadline(loop, 10.0):
                entered.set()
                await loop.create_future()

        task = asyncio.create_task(guarded())
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
