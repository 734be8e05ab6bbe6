"""A delaying TCP proxy, for kernels without `sch_netem`: `python -m loadtests.scale.delay`.

Run in the database host's namespace, in front of its Postgres: every chunk is held half of
`delay` ± half of `jitter` seconds (uniform) in each direction, so that each round trip takes
`delay` ± `jitter` longer, as `netem delay 20ms 5ms` on a farm host's link would make it; split
over both directions because a long link delays both (a request-only delay lets a claim sent
before a commit find the row on arrival, and lag looks better than any real link allows).
Bytes never overtake each other (a chunk is released no earlier than the one before it), since
TCP would put them back in order anyway.

Prints `listening` on stdout once it accepts connections; stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal
import sys

CHUNK = 65536


async def _pipe(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    delay: float,
    jitter: float,
) -> None:
    """Copy `reader` to `writer`, each chunk released after its delay, in order."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def release() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()

    releaser = asyncio.create_task(release())
    last = 0.0
    try:
        while data := await reader.read(CHUNK):
            if delay > 0:
                last = max(loop.time() + random.uniform(delay - jitter, delay + jitter), last)
            queue.put_nowait((last, data))
        queue.put_nowait((last, b""))
        await releaser
    finally:
        releaser.cancel()


async def serve(
    listen: tuple[str, int], target: tuple[str, int], delay: float, jitter: float
) -> None:
    async def connection(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*target)
        except OSError:
            client_w.close()
            return
        tasks = [
            asyncio.create_task(_pipe(client_r, server_w, delay / 2, jitter / 2)),
            asyncio.create_task(_pipe(server_r, client_w, delay / 2, jitter / 2)),
        ]
        with contextlib.suppress(OSError, asyncio.CancelledError):
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            task.cancel()
        for w in (client_w, server_w):
            w.close()

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    server = await asyncio.start_server(connection, *listen, reuse_address=True, backlog=512)
    print("listening", flush=True)
    async with server:
        await stop.wait()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.scale.delay")
    parser.add_argument("--listen", required=True, type=_address, help="host:port")
    parser.add_argument("--target", required=True, type=_address, help="host:port")
    parser.add_argument(
        "--delay",
        type=float,
        default=0.020,
        help="added to each round trip, seconds (default 0.020)",
    )
    parser.add_argument("--jitter", type=float, default=0.005, help="± seconds (default 0.005)")
    args = parser.parse_args(argv)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run  # type: ignore[assignment]
    runner(serve(args.listen, args.target, args.delay, args.jitter))
    return 0


if __name__ == "__main__":
    sys.exit(main())
