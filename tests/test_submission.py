"""The engine-thread-to-event-loop relay of outputs (serving/submission.py's OutputRelay)."""

from __future__ import annotations

import asyncio
import threading

from qwen35_jax.serving.engine import RequestOutput
from qwen35_jax.serving.submission import OutputRelay


def test_the_relay_delivers_in_order_and_wakes_the_loop_once_per_batch():
    """Outputs put from another thread while the loop is busy arrive in order, each on its own queue, after one
    wake-up of the loop; an output put after that drain wakes it again."""

    async def main():
        loop = asyncio.get_running_loop()
        relay, queues, wakeups = OutputRelay(loop), [asyncio.Queue(), asyncio.Queue()], []
        schedule = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args: (wakeups.append(args[0]), schedule(*args))

        def engine_step(step: int):
            for token in range(50):
                relay.put(queues[token % 2], RequestOutput(f"r{token % 2}", [step * 100 + token], "", None))

        def step_while_the_loop_is_busy(step: int):
            thread = threading.Thread(target=engine_step, args=(step,))
            thread.start()
            thread.join()  # blocks the loop: it cannot drain before the step has put all 50

        step_while_the_loop_is_busy(0)
        assert wakeups == [relay._drain]
        await asyncio.sleep(0)
        assert [queues[0].get_nowait().token_ids[0] for _ in range(25)] == list(range(0, 50, 2))
        assert [queues[1].get_nowait().token_ids[0] for _ in range(25)] == list(range(1, 50, 2))
        step_while_the_loop_is_busy(1)
        await asyncio.sleep(0)
        assert wakeups == [relay._drain] * 2
        assert queues[0].qsize() == 25 and queues[0].get_nowait().token_ids == [100]

    asyncio.run(main())


def test_the_relay_drops_outputs_once_the_loop_is_closed():
    loop = asyncio.new_event_loop()
    relay = OutputRelay(loop)
    loop.close()
    relay.put(asyncio.Queue(), RequestOutput("r", [1], "", None))
    assert relay._pending == []
