"""`python -m megatron_searchr1.train ...` in which one rank dies hard (os._exit(9), no message): the rollout rank (the
last one) as it starts generating its second batch (streamed groups: at its fourth turn of the pool), or, with
ASYNC_DIE_RANK=1 (or 0), that trainer rank as it takes its second batch. With ASYNC_KILL_SERVER_PID nobody dies: the
rollout rank SIGKILLs that retrieval server as it starts its second batch, and searches through its guard. tests/trainer/test_async_rl.py checks that every
other rank stops with an error naming the dead one instead of waiting."""
from __future__ import annotations

import os
import signal
import sys

from megatron_searchr1.rollout import loop

if __name__ == "__main__":
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    die = int(os.environ.get("ASYNC_DIE_RANK", world - 1))
    server_pid = int(os.environ.get("ASYNC_KILL_SERVER_PID", "0"))
    if server_pid and rank == world - 1:  # the rollout rank SIGKILLs the retrieval server as it starts batch 1
        real, calls = loop.run_rollout, []

        def killing_run_rollout(*args, **kw):
            calls.append(1)
            if len(calls) == 2:
                os.kill(server_pid, signal.SIGKILL)
                for _ in range(3):  # the tiny random policy seldom searches: ask through the rank's own guard
                    args[2](["who wrote it"])
            return real(*args, **kw)

        loop.run_rollout = killing_run_rollout
    elif rank == die == world - 1:
        real, calls = loop.run_rollout, []

        def dying_run_rollout(*args, **kw):
            calls.append(1)
            if len(calls) == 2:
                os._exit(9)
            return real(*args, **kw)

        loop.run_rollout = dying_run_rollout  # serve_rollouts calls it through the module
        if "rollout.async_granularity=group" in sys.argv:  # streamed groups: one turn of the pool per call
            real_advance, turns = loop.advance, []

            def dying_advance(*args, **kw):
                turns.append(1)
                if len(turns) == 4:  # past the first batch's groups (2 per rank, at most 2 turns each)
                    os._exit(9)
                return real_advance(*args, **kw)

            loop.advance = dying_advance  # rollout_stream calls it through the module
    elif rank == die:
        from megatron_searchr1.trainer.async_rl import AsyncTrainer

        real_gen, gen_calls = AsyncTrainer.generate_batch, []

        def dying_generate_batch(self):
            gen_calls.append(1)
            if len(gen_calls) == 2:
                os._exit(9)
            return real_gen(self)

        AsyncTrainer.generate_batch = dying_generate_batch
    from megatron_searchr1.train import cli

    sys.exit(cli())
