"""The one sync/async bridge: flows driven both ways, async work from sync code, one worker."""

from __future__ import annotations

import asyncio
import contextvars
import signal
import threading
import time

import pytest

from llama_index.packs.self_rag_rse.common.bridge import (
    SerialWorker,
    adrive,
    drive,
    iterate_sync,
    run_blocking,
    run_sync,
)
from llama_index.packs.self_rag_rse.common.notes import collect_notes, record_note


def flow():
    a = yield "x"
    b = yield a + "y"
    return a + b


def test_drive_and_adrive_give_the_same_result():
    assert drive(flow(), lambda request: request * 2) == "xx" + "xxyxxy"

    async def double(request):
        await asyncio.sleep(0)
        return request * 2

    assert asyncio.run(adrive(flow(), double)) == "xxxxyxxy"


def test_run_sync_works_inside_a_running_loop():
    async def inner() -> int:
        await asyncio.sleep(0)
        return 7

    async def outer() -> int:
        return run_sync(inner())  # blocks only this thread

    assert asyncio.run(outer()) == 7
    assert run_sync(inner()) == 7


def test_run_sync_propagates_exceptions():
    async def boom() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError):
        run_sync(boom())


def test_run_sync_runs_in_the_callers_context():
    span = contextvars.ContextVar("span", default="none")
    span.set("caller's span")

    async def read() -> str:
        return span.get()

    assert run_sync(read()) == "caller's span"


def test_a_caller_that_gives_up_cancels_the_work():
    started, cancelled = threading.Event(), threading.Event()

    async def forever() -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(KeyboardInterrupt):
            run_sync(forever())
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert started.is_set()
    assert cancelled.wait(5)


def test_serial_worker_runs_calls_in_one_thread_in_order():
    worker = SerialWorker("test-worker")
    seen: list[tuple[int, str]] = []

    def job(i: int) -> int:
        seen.append((i, threading.current_thread().name))
        return i

    async def main() -> list[int]:
        return await asyncio.gather(*(worker.run(job, i) for i in range(5)))

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
    assert len({name for _, name in seen}) == 1
    worker.close()
    assert asyncio.run(worker.run(job, 9)) == 9  # a closed worker starts again
    worker.close()


def test_notes_reach_only_the_collecting_caller():
    record_note("nobody", "dropped: nobody collects")
    with collect_notes() as notes:
        record_note("a", "why")
    assert notes == [("a", "why")]

    async def task(name: str) -> list[tuple[str, str]]:
        with collect_notes() as mine:
            await asyncio.sleep(0)
            record_note(name, name)
            await asyncio.sleep(0)
        return mine

    async def main():
        return await asyncio.gather(task("1"), task("2"))

    assert asyncio.run(main()) == [[("1", "1")], [("2", "2")]]


def test_a_sync_stream_closed_on_the_loops_own_thread_closes_its_async_stream():
    # The garbage collector may finalize an abandoned sync stream on the private loop's thread;
    # closing it there called run_sync from inside the loop, which refuses: the stream was left
    # open and "a synchronous method was called from inside its own async work" was printed.
    closed = threading.Event()

    async def pieces():
        try:
            yield "a"
            yield "b"
        finally:
            closed.set()

    stream = iterate_sync(pieces())
    assert next(stream) == "a"

    async def close_here() -> None:
        stream.close()

    run_sync(close_here())
    assert closed.wait(5)


def blocking_threads() -> int:
    return sum(t.name.startswith("self-rag-rse-blocking") for t in threading.enumerate())


def test_blocking_threads_made_for_a_burst_exit_once_it_is_over():
    # A long-running app: a burst of 60 blocking retrievals at once needs 60 threads (no cap:
    # one that queries another engine must never wait for a place), but they used to stay for
    # the life of the process.
    burst = 60
    together = threading.Barrier(burst, timeout=30)  # every call in flight at once

    def retrieval(i: int) -> int:
        together.wait()
        return i

    async def main() -> list[int]:
        return await asyncio.gather(*(run_blocking(retrieval, i) for i in range(burst)))

    assert asyncio.run(main()) == list(range(burst))
    deadline = time.monotonic() + 10
    while blocking_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert blocking_threads() == 0
    # Later calls get threads again, and a failure still reaches its caller.
    assert asyncio.run(main()) == list(range(burst))

    async def failing() -> None:
        await run_blocking(int, "not a number")

    with pytest.raises(ValueError, match="not a number"):
        asyncio.run(failing())
