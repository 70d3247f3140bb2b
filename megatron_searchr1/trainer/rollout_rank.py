"""A rollout rank of the disaggregated placement: its share of every batch, with the newest weights it holds.

    serve_rollouts(cfg, bridge)     # trainer/async_rl.py run_disaggregated, on each of the last K ranks

The loop, batch after batch from the run's (or the resume's) first batch: draw the batch's prompts (every rollout
rank draws every batch with the same seed, so the data cursor is the batch index), take this rank's contiguous share
of them (rollout/batch_parts.py `share`: GRPO groups never split), wait until a policy version recent enough for the
batch has arrived (async_buffer.required_version), load the newest weights received, generate the share with the
vLLM engine and the retrieval client (the multi-turn search loop, rollout/loop.py), score it, send it to trainer
rank 0 as a part, and go on to the next batch: the other rollout ranks are not waited for, each runs ahead on its
own within the staleness bound. A rank whose share is empty (fewer prompts per batch than rollout ranks) generates
nothing and only validates.

With `rollout.async_granularity: group` the rank streams GRPO groups instead of shares (trainer/rollout_stream.py:
a fixed stream of groups per rank, several in flight, a finished group sent at once and its slot refilled between
two turns, across batch boundaries); setup, validation and the end are the same.

Sampling seeds: the trainer's seed for the batch's step plus this rank's index x SHARE_SEED_STRIDE, so every part of
every batch draws its own noise, the same in every run of the same config.

Validation, when the trainer marked a version for it (WeightReceiver.take_due), between two of this rank's batches:
its contiguous share of the validation rows, sent to trainer rank 0 as a part of the report, which assembles the
report once every rollout rank's part is in (trainer/async_rl.py).

Partial rollouts (`rollout.partial`): newer weights are also loaded between two turns of a share's multi-turn loop
(the `weights` hook of loop.run_rollout), so a trajectory continues under them; each token keeps its version.

The end: after its last batch the rank validates what is still due until the trainer says STOP, then sends DONE on
the batches channel (trainer rank 0 drains until every rank said it); on an error it sends the error first, so
trainer rank 0 reports it as one line naming this rank (and answers with STOP at once), and fails. On every path the
rank stops what it started (`_Started`): its weight receiver's thread is ended and joined (a thread left in a gloo
receive while the interpreter finalises aborts the process), the engine, the client and a launched server closed.
"""
from __future__ import annotations

import dataclasses
import time

import torch.distributed as dist

from megatron_searchr1 import interrupt
from megatron_searchr1.rollout.async_buffer import GeneratedBatch, required_version, sample_version
from megatron_searchr1.rollout.batch_parts import share
from megatron_searchr1.rollout.engines import vllm_routing
from megatron_searchr1.rollout.remote_receiver import WeightReceiver
from megatron_searchr1.rollout.remote_sync import BATCHES_TAG, DONE, Bridge, recv_object, send_object
from megatron_searchr1.trainer.rollout_stream import StreamRank, stream_groups

CHECKED_TENSORS = 4
"""How many received tensors a rollout rank reads back from its engine after each load (sync/remote_check_*)."""


def _engine_tensors(worker, names: list[str]) -> dict:
    """Inside the vLLM worker (this process): copies of the model's parameters of these HF names, where vLLM keeps
    them under the same name (norms, o_proj, down_proj; not the stacked qkv / gate_up)."""
    params = dict(worker.model_runner.model.named_parameters())
    return {n: params[n].detach().float().clone() for n in names if n in params}


def check_engine_weights(engine, pairs: list) -> tuple[float, int]:
    """(largest |engine - sent| over up to CHECKED_TENSORS sent tensors the engine keeps under their HF names,
    how many were compared). Only for the vLLM engine (nan, 0 otherwise)."""
    llm = getattr(engine, "llm", None)
    if llm is None:
        return float("nan"), 0
    sent = {n: t for n, t in pairs}
    got = llm.collective_rpc(_engine_tensors, args=(list(sent),))[0]
    names = [n for n in sent if n in got and tuple(got[n].shape) == tuple(sent[n].shape)][:CHECKED_TENSORS]
    if not names:
        return float("nan"), 0
    return max(float((got[n] - sent[n].float()).abs().max()) for n in names), len(names)


RECEIVER_JOIN_SECONDS = 10.0
"""How long a rollout rank that stops waits for its weight receiver's thread to end (trainer rank 0 answers its error or
DONE with STOP at once; a dead trainer closes the connection): trainer/async_rl.py exits hard if it is still alive."""


class _Started:
    """What a rollout rank started and must stop on every exit path (module doc): the weight receiver's thread, the
    engine, the retrieval client, the retrieval server it launched."""

    receiver = engine = client = server = None

    def close(self) -> None:
        steps = [("receiver", lambda: self.receiver.close(timeout=RECEIVER_JOIN_SECONDS)),
                 ("engine", lambda: self.engine.close() if hasattr(self.engine, "close") else None),
                 ("client", lambda: self.client.close()), ("server", lambda: self.server.stop())]
        for name, stop in steps:
            if getattr(self, name) is not None:
                try:
                    stop()
                except Exception:  # noqa: BLE001 (the rank is stopping; the error that stopped it is the one to report)
                    pass


def serve_rollouts(cfg, bridge: Bridge) -> None:
    """A rollout rank's whole run (module doc): its share of each batch, with the newest weights it has, within the
    bound. Whatever it started is stopped, and its threads joined, on every exit path."""
    started = _Started()
    try:
        _serve(cfg, bridge, started)
    finally:
        started.close()


def _serve(cfg, bridge: Bridge, started: _Started) -> None:
    from megatron_searchr1.data.rl_data import PromptSampler
    from megatron_searchr1.models.convert import load_hf_config
    from megatron_searchr1.rollout import loop
    from megatron_searchr1.rollout.engine_groups import SHARE_SEED_STRIDE
    from megatron_searchr1.rollout.engines import make_engine
    from megatron_searchr1.rollout.loop import settings_from_config
    from megatron_searchr1.search.client import RetrievalClient, SearchGuard
    from megatron_searchr1.trainer import losses, reports
    from megatron_searchr1.trainer.build import engine_kwargs, launch_server, load_data, load_tokenizer
    from megatron_searchr1.trainer.rl import step_seed
    from megatron_searchr1.trainer.roles import RolloutWorker
    from megatron_searchr1.trainer.sources import stop_token_ids

    r, q, t = cfg.rollout, cfg.retrieval, cfg.trainer
    plan, me = bridge.plan, bridge.bridge_rank - 1  # me: 0..K-1
    hf_config = load_hf_config(cfg.model.path)
    tokenizer = load_tokenizer(cfg.model.path, hf_config, cfg.data.chat_template)
    data = load_data(cfg, tokenizer, log=False)
    receiver = started.receiver = WeightReceiver(bridge)
    url = q.url
    if q.launch:  # the rollout ranks are the only clients: the first of them on each node starts its server
        started.server, url = launch_server(cfg)
        if started.server is not None:
            print(f"rank {bridge.rank} (rollout): started the retrieval server {url} for this node's rollout ranks",
                  flush=True)
    engine = started.engine = make_engine(r.engine, cfg.model.path, **engine_kwargs(cfg, dist.get_rank()))
    receiver.engine_ready.set()  # weights over NCCL: its buffers come after vLLM took its share of the GPU
    client = started.client = RetrievalClient(url, topk=q.topk, timeout=q.timeout,
                                              doc_ids=r.protocol == "tool_calls")
    guard = SearchGuard(client.search, url, q.max_error_rate, q.max_failed_rounds)
    settings, val_settings = settings_from_config(r, stop_token_ids(tokenizer, cfg.model.path), t.seed,
                                                  tools_url=client.base_url)

    def validate_due() -> None:
        """Validate this rank's share of the rows with each version the trainer marked, and send it to trainer rank
        0 (which assembles the report from every rank's part)."""
        while (due := receiver.take_due()) is not None:
            interrupt.note(f"validating version {due.version}")
            receiver.load_due(engine, due)  # frees its host slot: the next version may be waiting for it
            validate(due.version)

    def validate(version: int) -> None:
        rows = [data.val[i] for i in share(len(data.val), me, plan.rollout_ranks)]
        records, samples = [], []
        for start in range(0, len(rows), cfg.data.val_batch_size):
            trajs = RolloutWorker.make_trajectories(rows[start:start + cfg.data.val_batch_size], 1)
            loop.run_rollout(engine, tokenizer, guard, trajs, val_settings)
            for tr, sc in zip(trajs, losses.score_trajectories(trajs, tokenizer, cfg.algo)):
                if len(samples) < cfg.logging.trajectories_per_step:
                    samples.append(reports.eval_sample(tokenizer, tr, sc))
                records.append(reports.eval_record(tr, sc))
        guard.take()  # validation's searches are in the report's records, not in the next batch's error rate
        send_object(bridge.batches, {"val": version, "part": me, "records": records, "samples": samples}, 0,
                    BATCHES_TAG)

    start = recv_object(bridge.batches, 0, BATCHES_TAG)
    first_batch, first_version = start["first_batch"], start["first_version"]
    interrupt.reassert()  # Ctrl-C: our one-line exit, whatever vLLM installed while the engine was built
    sampler = PromptSampler(len(data.train), cfg.data.train_batch_size, t.seed, cfg.data.shuffle)
    for _ in range(first_batch):  # the data cursor: batch b is the b-th draw, whichever run drew the earlier ones
        sampler.next_batch()
    mine = share(cfg.data.train_batch_size, me, plan.rollout_ranks)  # this rank's prompts of every batch
    check = (float("nan"), 0)

    def weights() -> int:
        """Load the newest weights received, if newer than the engine's (before a share; with rollout.partial also
        between the turns of one), and check them; the version the engine holds."""
        nonlocal check
        loaded = receiver.apply(engine, inspect=lambda pairs: check_engine_weights(engine, pairs))
        if loaded is not None:
            check = loaded[1]
        return receiver.applied_version

    def sync_check() -> dict:
        """The last weights check, as sync/remote_* values of a part (without the prefix; the part adds its
        version, remote_applied_version)."""
        return {"remote_check_max_diff": check[0], "remote_check_tensors": float(check[1])}

    streamed = r.async_granularity == "group"
    end = t.total_steps if len(mine) and not streamed else first_batch  # without a share: only validates
    try:
        if streamed:  # GRPO groups streamed across batches instead of shares (trainer/rollout_stream.py)
            stream_groups(StreamRank(cfg, bridge, me, engine, tokenizer, guard, data, sampler, receiver, settings,
                                     first_batch, first_version, weights, validate_due, sync_check))
        for b in range(first_batch, end):
            batch = sampler.next_batch()
            rows = [data.train[batch[i]] for i in mine]
            interrupt.note(f"generating batch {b} of {t.total_steps}")
            if (receiver.stopped or not receiver.wait_for(required_version(b, r.max_staleness, first_version),
                                                          serve=validate_due) or receiver.stopped):
                break  # the trainer stopped early (trainer.stop_on_collapse, or an error: stop_reason)
            validate_due()
            version = weights()  # the oldest version of this share's tokens
            gen_start = time.time()
            trajs = RolloutWorker.make_trajectories(rows, r.n)
            seed = step_seed(t.seed, b + 1) + me * SHARE_SEED_STRIDE  # batch b is trained at step b+1
            stats = loop.run_rollout(engine, tokenizer, guard, trajs, dataclasses.replace(settings, seed=seed),
                                     weights=weights if r.partial else lambda: version)
            if cfg.algo.routing_replay:  # the engine's experts per token travel with the trajectories
                vllm_routing.attach(engine, trajs)
            for tr in trajs:  # per sample, its oldest token's version (the staleness histogram) and its maker
                tr.meta["policy_version"] = sample_version(tr.versions, tr.loss_mask, default=version)
                tr.meta["rollout_rank"] = bridge.rank
            scores = losses.score_trajectories(trajs, tokenizer, cfg.algo)
            failed, searched, opened, last = guard.take()
            guard.down(failed, searched, opened, last, f"batch {b} on rollout rank {bridge.rank}")  # raises to stop
            payload = {"trajs": trajs, "scores": scores, "stats": stats, "search": (failed, searched),
                       "sync": {**sync_check(), "remote_applied_version": float(version)}}
            send_object(bridge.batches, GeneratedBatch(index=b, version=version, payload=payload, gen_start=gen_start,
                                                       gen_end=time.time(), rank=bridge.rank, extra={"part": me}),
                        0, BATCHES_TAG)
        interrupt.note("waiting for the trainer's stop")
        while True:  # a validation asked for after the last batch (the final one) comes before STOP
            validate_due()
            if receiver.stopped:
                break
            receiver.wait_due_or_stop()
    except BaseException as e:
        # tell the trainer why, if it still listens; then fail this rank (torchrun stops the job)
        try:
            send_object(bridge.batches, {"error": f"{type(e).__name__}: {e}"}, 0, BATCHES_TAG)
        except Exception:  # noqa: BLE001 (the trainer may be gone too)
            pass
        raise
    send_object(bridge.batches, DONE, 0, BATCHES_TAG)  # trainer rank 0 drains until it hears this
    if receiver.stop_reason:
        err = RuntimeError(f"rank {bridge.rank} (rollout): trainer rank 0 stopped the run: {receiver.stop_reason}")
        err.stopping_line = str(err)  # run_disaggregated prints it as it is
        raise err
