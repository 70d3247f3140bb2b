"""`python -m megatron_searchr1.train ...` in which one rank dies hard (os._exit(9), no message): the rollout rank (the
last one) as it starts generating its second batch (streamed groups: at its fourth turn of the pool), or, with
ASYNC_DIE_RANK=1, trainer rank 1 as it takes its second batch. tests/trainer/test_async_rl.py checks that every
other rank stops with an error naming the dead one instead of waiting."""
from __future__ import annotations

import os
import sys

from megatron_searchr1.rollout import loop

if __name__ == "__main__":
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    die = int(os.environ.get("ASYNC_DIE_RANK", world - 1))
    if rank == die == world - 1:
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
