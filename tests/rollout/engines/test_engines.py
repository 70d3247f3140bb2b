"""Tests for megatron_searchr1/rollout/engines/: the hf reference engine, the vLLM engine, make_engine.

The hf engine is checked against transformers itself (generate() and a teacher-forced forward pass); the vLLM engine
is checked against the hf engine on the same weights (fp32): greedy tokens equal, log-probs within 1e-4.

Stop tags are forced deterministically by relabelling: swapping the embedding and lm_head rows of two token ids gives
the same model with the two ids exchanged, so its greedy output is the original one with the ids exchanged. Swapping
a token that the original greedily emits at step k with `</search>` makes the new model emit `</search>` at step k.
"""
import os
import sys

import pytest
import torch

from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model
from megatron_searchr1.rollout.engine import Generation, SamplingParams
from megatron_searchr1.rollout.engines import make_engine
from megatron_searchr1.rollout.engines.hf_engine import HFEngine

HERE = os.path.dirname(os.path.abspath(__file__))
TEXTS = ["The capital of france is", "<think> I need to find who the author of hamlet", "Water is wet.",
         "<information> Doc 1 (Title: \"the moon\") the moon", "how many", "The river nile lies near"]
GREEDY = SamplingParams(max_tokens=24, temperature=0)


def _vllm_importable() -> str:
    """'' when vllm imports, else the reason (only the slow tests ask, so the quick ones never pay for the import)."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # ImportError, or a broken install (e.g. CPU torch with CUDA torchvision)
        return f"{type(e).__name__}: {e}"
    return ""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny Qwen2 models with the same tokenizer and different random weights (A: seed 0, B: seed 1)."""
    import shutil

    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("engines")
    a = make_tiny_model(TinyModelConfig(output_dir=str(root / "A"), seed=0, init_std=0.1))
    b = shutil.copytree(a, str(root / "B"))  # same tokenizer and config (training a tokenizer takes seconds)
    model = AutoModelForCausalLM.from_pretrained(a)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.1 * torch.randn_like(p))
    model.save_pretrained(b)
    return {"A": a, "B": b}


@pytest.fixture(scope="module")
def tok(models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models["A"])


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def hf_a(models):
    return HFEngine(models["A"])


@pytest.fixture(scope="module")
def hf_b(models):
    return HFEngine(models["B"])


def weights_of(model_dir):
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


def teacher_forced_logprobs(model, prompt, gen_ids, temperature=1.0, top_k=-1, top_p=1.0):
    """log p(gen_ids[i] | prompt + gen_ids[:i]) under the sampling distribution, from one plain forward pass of the
    transformers model: logits / temperature, keep the top_k largest, then the smallest set of most likely tokens
    whose probability reaches top_p, renormalise (temperature 0: the untempered distribution)."""
    ids = torch.tensor([prompt + gen_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()                                           # (T, V)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(gen_ids) - 1)
    out = []
    for p, tok in zip(pos.tolist(), gen_ids):
        z = logits[p] / (temperature or 1.0)                                            # (V,)
        keep = torch.ones_like(z, dtype=torch.bool)
        if top_k > 0:
            keep &= z >= torch.sort(z, descending=True).values[top_k - 1]
        if top_p < 1.0:
            probs = torch.softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
            order = torch.argsort(probs, descending=True)
            mass_before = torch.cumsum(probs[order], dim=0) - probs[order]
            nucleus = torch.zeros_like(keep)
            nucleus[order[mass_before < top_p]] = True
            keep &= nucleus
        out.append(float(torch.log_softmax(z.masked_fill(~keep, float("-inf")), dim=-1)[tok]))
    return out


def relabelled(weights, a, b):
    """The same model with token ids a and b exchanged (embedding and lm_head rows swapped)."""
    out = dict(weights)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = weights[name].clone()
        w[[a, b]] = w[[b, a]]
        out[name] = w
    return out


def forced_stop_case(hf_a, prompts, tok):
    """Swaps {token: tag} that make model A's relabelled twin emit </search> and </answer> mid-output, and the
    expected stopped outputs (the relabelled greedy outputs cut after their first tag)."""
    base = hf_a.generate(prompts, GREEDY)
    tags = [tok.convert_tokens_to_ids("</search>"), tok.convert_tokens_to_ids("</answer>")]
    swaps = {}
    for gen in base:
        for k, t in enumerate(gen.token_ids[2:], start=2):  # a token first emitted at step k >= 2
            if t not in gen.token_ids[:k] and t not in swaps and t not in tags:
                swaps[t] = tags[len(swaps)]
                break
        if len(swaps) == len(tags):
            break
    assert len(swaps) == 2, "the greedy outputs are too repetitive to pick two tokens to relabel"
    expected = []
    for gen in base:
        ids = swap_ids(gen.token_ids, swaps)
        cut = next((j for j, t in enumerate(ids) if t in tags), None)
        expected.append(ids if cut is None else ids[:cut + 1])
    assert {e[-1] for e in expected} >= set(tags)  # both tags end some output
    return swaps, base, expected


def twin_weights(model_dir, swaps):
    w = weights_of(model_dir)
    for t, tag in swaps.items():
        w = relabelled(w, t, tag)
    return w


def swap_ids(ids, swaps):
    table = {**swaps, **{v: k for k, v in swaps.items()}}
    return [table.get(t, t) for t in ids]


# ---------------------------------------------------------------------------------------------------------------
# hf engine (quick)
# ---------------------------------------------------------------------------------------------------------------
def test_hf_greedy_matches_transformers_generate_and_forward(hf_a, prompts):
    outs = hf_a.generate(prompts, GREEDY)  # one left-padded batch of prompts of different lengths
    for prompt, out in zip(prompts, outs):
        ref = hf_a.model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                                  min_new_tokens=GREEDY.max_tokens, eos_token_id=None, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt):].tolist()
        assert out.finish_reason == "length" and out.stop_reason is None
        ref_lp = teacher_forced_logprobs(hf_a.model, prompt, out.token_ids)
        assert max(abs(x - y) for x, y in zip(out.logprobs, ref_lp)) < 1e-4


def test_hf_sampling_is_seeded_per_prompt(hf_a, prompts):
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=7)
    batch = hf_a.generate(prompts, p)
    again = hf_a.generate(prompts, p)
    assert [g.token_ids for g in batch] == [g.token_ids for g in again]
    # prompt 0 sampled alone gets the same seed (index 0) and hence the same tokens as inside the batch
    assert hf_a.generate(prompts[:1], p)[0].token_ids == batch[0].token_ids
    other = hf_a.generate(prompts, SamplingParams(max_tokens=16, temperature=1.0, seed=8))
    assert [g.token_ids for g in other] != [g.token_ids for g in batch]
    # log-probs are under the sampling distribution (temperature, top-k, top-p), computed by hand here
    hot = hf_a.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.5, top_k=20, top_p=0.9, seed=1))
    for prompt, g in zip(prompts, hot):
        ref = teacher_forced_logprobs(hf_a.model, prompt, g.token_ids, temperature=0.5, top_k=20, top_p=0.9)
        assert max(abs(x - y) for x, y in zip(g.logprobs, ref)) < 1e-4
        untempered = teacher_forced_logprobs(hf_a.model, prompt, g.token_ids)
        assert max(abs(x - y) for x, y in zip(g.logprobs, untempered)) > 1e-2  # the temperature shows


def test_hf_stops_at_tags_and_stop_ids(models, hf_a, prompts, tok):
    swaps, base, expected = forced_stop_case(hf_a, prompts, tok)
    twin = HFEngine(models["A"])
    twin.load_weights(twin_weights(models["A"], swaps).items())
    free = twin.generate(prompts, GREEDY)  # no stop: the relabelled greedy output, tags included mid-way
    assert [g.token_ids for g in free] == [swap_ids(g.token_ids, swaps) for g in base]
    stopped = twin.generate(prompts, SamplingParams(max_tokens=24, temperature=0, stop=("</search>", "</answer>")))
    assert [g.token_ids for g in stopped] == expected
    for g in stopped:
        if g.finish_reason == "stop":
            assert g.stop_reason == tok.convert_ids_to_tokens(g.token_ids[-1])
    # a stop token id: ends at its first occurrence and is kept
    stop_id = base[0].token_ids[3]
    k = base[0].token_ids.index(stop_id)
    out = hf_a.generate([prompts[0]], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(stop_id,)))[0]
    assert out.token_ids == base[0].token_ids[:k + 1] and out.stop_reason == stop_id and out.finish_reason == "stop"


def test_hf_load_weights_switches_model(models, hf_b, prompts):
    engine = HFEngine(models["A"])
    before = engine.generate(prompts, GREEDY)
    engine.load_weights(weights_of(models["B"]).items())
    after = engine.generate(prompts, GREEDY)
    ref = hf_b.generate(prompts, GREEDY)
    assert [g.token_ids for g in after] == [g.token_ids for g in ref]
    assert [g.token_ids for g in after] != [g.token_ids for g in before]
    with pytest.raises(KeyError, match="not a parameter"):
        engine.load_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([("lm_head.weight", torch.zeros(3, 3))])


def test_make_engine_rejects_unknown_name(models):
    with pytest.raises(ValueError, match="unknown rollout engine 'sglang'.*vllm, hf"):
        make_engine("sglang", models["A"])
    assert isinstance(make_engine("hf", models["A"]), HFEngine)


# ---------------------------------------------------------------------------------------------------------------
# vLLM engine (slow: one engine start per module, 10-30 s on a busy 2-core machine)
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_a(models):
    reason = _vllm_importable()
    if reason:
        pytest.skip(f"vllm does not import ({reason}); install the cpu or gpu extra")
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    engine = make_engine("vllm", models["A"], dtype="float32", kv_cache_gib=0.25, seed=0)
    engine.rng_state_kept = torch.equal(torch.get_rng_state(), before)  # vLLM re-seeds in-process; we restore
    yield engine
    engine.close()


def assert_same(vllm_outs: list[Generation], hf_outs: list[Generation], tol=1e-4):
    assert [g.token_ids for g in vllm_outs] == [g.token_ids for g in hf_outs]
    for v, h in zip(vllm_outs, hf_outs):
        assert (v.finish_reason, v.stop_reason) == (h.finish_reason, h.stop_reason)
        assert max(abs(x - y) for x, y in zip(v.logprobs, h.logprobs)) < tol


@pytest.mark.slow
def test_vllm_greedy_equals_hf(vllm_a, hf_a, prompts):
    assert vllm_a.rng_state_kept  # starting the engine left the process-global torch RNG where it was
    assert_same(vllm_a.generate(prompts, GREEDY), hf_a.generate(prompts, GREEDY))


@pytest.mark.slow
def test_vllm_sampling_logprobs_are_at_the_sampling_temperature_and_seeded(vllm_a, hf_a, prompts):
    p = SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, seed=11)
    outs = vllm_a.generate(prompts, p)
    for prompt, g in zip(prompts, outs):  # log p under the distribution it was sampled from (vLLM processed)
        ref = teacher_forced_logprobs(hf_a.model, prompt, g.token_ids, temperature=0.7, top_p=0.9)
        assert max(abs(x - y) for x, y in zip(g.logprobs, ref)) < 1e-4
    # without top-p: what the trainer computes at the sampling temperature (logits / 0.7)
    plain = vllm_a.generate(prompts, SamplingParams(max_tokens=16, temperature=0.7, seed=11))
    for prompt, g in zip(prompts, plain):
        ref = teacher_forced_logprobs(hf_a.model, prompt, g.token_ids, temperature=0.7)
        assert max(abs(x - y) for x, y in zip(g.logprobs, ref)) < 1e-4
    assert [g.token_ids for g in vllm_a.generate(prompts, p)] == [g.token_ids for g in outs]


def _generators_seen():
    """The number of per-request generators vLLM's sampler gets at each sampling step (class-level wrap of
    Sampler.sample), and a function that stops recording."""
    from vllm.v1.sample.sampler import Sampler

    original, seen = Sampler.sample, []

    def sample(self, logits, sampling_metadata, *args, **kwargs):
        seen.append(len(sampling_metadata.generators))
        return original(self, logits, sampling_metadata, *args, **kwargs)

    Sampler.sample = sample
    return seen, lambda: setattr(Sampler, "sample", original)


@pytest.mark.slow
def test_vllm_samples_one_seeded_stream_per_call(vllm_a, prompts):
    """A seeded call samples from one random stream seeded from params.seed: no request has a generator of its own
    (vLLM's per-request sampling loop), the same batch and seed give the same tokens twice, and the process-global
    RNGs are where the caller left them."""
    import random

    p = SamplingParams(max_tokens=16, temperature=1.0, seed=21)
    torch.manual_seed(5)
    random.seed(5)
    before = torch.get_rng_state(), random.getstate()
    seen, stop = _generators_seen()
    try:
        outs = vllm_a.generate(prompts, p)
    finally:
        stop()
    assert seen and set(seen) == {0}, seen  # sampled steps, none with a per-request generator
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert [g.token_ids for g in vllm_a.generate(prompts, p)] == [g.token_ids for g in outs]
    other = vllm_a.generate(prompts, SamplingParams(max_tokens=16, temperature=1.0, seed=22))
    assert [g.token_ids for g in other] != [g.token_ids for g in outs]
    torch.manual_seed(77)  # the caller's state does not matter: the call seeds its own stream
    assert [g.token_ids for g in vllm_a.generate(prompts, p)] == [g.token_ids for g in outs]


@pytest.mark.slow
def test_vllm_seed_per_request_reproduces_per_prompt_seeding(vllm_a, prompts):
    """seed_per_request=True: each request carries its own seed (a generator per request in vLLM's sampler), so a
    prompt's sample does not depend on the rest of the batch."""
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=21)
    vllm_a.seed_per_request = True
    seen, stop = _generators_seen()
    try:
        outs = vllm_a.generate(prompts, p)
        assert max(seen) == len(prompts), seen
        assert vllm_a.generate(prompts[:1], p)[0].token_ids == outs[0].token_ids
        assert vllm_a.generate(prompts[::-1], p)[-1].token_ids != outs[0].token_ids  # index-derived seeds
        assert [g.token_ids for g in vllm_a.generate(prompts, p)] == [g.token_ids for g in outs]
    finally:
        stop()
        vllm_a.seed_per_request = False


@pytest.mark.slow
def test_vllm_nothing_after_stop_tag(vllm_a, hf_a, models, prompts, tok):
    stops = ("</search>", "</answer>")
    # 1. the invariant on many sampled outputs (a hot, flat distribution emits the tags now and then)
    outs = vllm_a.generate(prompts * 40, SamplingParams(max_tokens=48, temperature=2.0, stop=stops, seed=5))
    tag_ids = {tok.convert_tokens_to_ids(s) for s in stops}
    n_stopped = 0
    for g in outs:
        hits = [j for j, t in enumerate(g.token_ids) if t in tag_ids]
        if hits:
            n_stopped += 1
            assert hits == [len(g.token_ids) - 1] and g.finish_reason == "stop" and g.stop_reason in stops
        else:
            assert g.finish_reason == "length" and len(g.token_ids) == 48
    assert n_stopped > 0
    # 2. forced: the relabelled twin of A emits each tag at a known step (loaded into vLLM with load_weights)
    swaps, base, expected = forced_stop_case(hf_a, prompts, tok)
    w = twin_weights(models["A"], swaps)
    try:
        vllm_a.load_weights((n, w[n]) for n in ("model.embed_tokens.weight", "lm_head.weight"))
        vllm_a.finish_weight_sync()
        stopped = vllm_a.generate(prompts, SamplingParams(max_tokens=24, temperature=0, stop=stops))
        assert [g.token_ids for g in stopped] == expected
        for g in stopped:
            if g.finish_reason == "stop":
                assert g.stop_reason == tok.convert_ids_to_tokens(g.token_ids[-1])
    finally:
        vllm_a.load_weights(weights_of(models["A"]).items())
        vllm_a.finish_weight_sync()
    print(f"sampled outputs ending at a stop tag: {n_stopped}/{len(outs)}")


@pytest.mark.slow
def test_vllm_load_weights_switches_model_and_resets_prefix_cache(vllm_a, hf_a, hf_b, models, prompts, tok):
    long_prompt = tok.encode("The capital of france is paris. " * 40)  # several KV blocks: cacheable
    vllm_a.generate([long_prompt], GREEDY)  # fills the prefix cache
    assert vllm_a.generate([long_prompt], GREEDY)[0].num_cached_tokens > 0
    try:
        vllm_a.load_weights(weights_of(models["B"]).items())  # B's weights, A's engine: must become B
        vllm_a.finish_weight_sync()
        first = vllm_a.generate([long_prompt], GREEDY)[0]
        assert first.num_cached_tokens == 0  # the KV computed with A's weights is gone
        assert_same([first], hf_b.generate([long_prompt], GREEDY))
        assert_same(vllm_a.generate(prompts, GREEDY), hf_b.generate(prompts, GREEDY))
        assert [g.token_ids for g in hf_a.generate(prompts, GREEDY)] != [g.token_ids for g in hf_b.generate(prompts, GREEDY)]
    finally:
        vllm_a.load_weights(weights_of(models["A"]).items())  # a second sync, back to A
        vllm_a.finish_weight_sync()
    assert_same(vllm_a.generate(prompts, GREEDY), hf_a.generate(prompts, GREEDY))


@pytest.mark.slow
def test_vllm_sleep_and_wake_up_are_no_ops_on_the_cpu(vllm_a, hf_a, prompts):
    """vLLM has no sleep mode on the CPU: sleep() frees nothing and wake_up() has nothing to wake; the engine keeps
    generating with its weights. The GPU call order (wake weights, sync, wake KV cache) is tested with recording
    doubles in test_vllm_engine_unit.py and test_wake.py."""
    if not vllm_a.on_cpu:
        pytest.skip("sleep mode is real on GPUs: see test_vllm_engine_unit.py and test_wake.py")
    assert not vllm_a.sleep_mode
    assert vllm_a.sleep(level=2) is False and not vllm_a.sleeping  # no weights dropped: no sync needed
    vllm_a.wake_up()
    assert_same(vllm_a.generate(prompts[:2], GREEDY), hf_a.generate(prompts[:2], GREEDY))


def _scheduled(engine):
    """A counter of the tokens vLLM's scheduler runs (in-process engine core), and a function that stops counting."""
    scheduler = engine.llm.llm_engine.engine_core.engine_core.scheduler
    original, count = scheduler.schedule, [0]

    def counted(*args, **kwargs):
        out = original(*args, **kwargs)
        count[0] += out.total_num_scheduled_tokens
        return out

    scheduler.schedule = counted
    return count, lambda: setattr(scheduler, "schedule", original)


@pytest.mark.slow
def test_vllm_sessions_continue_turns_computing_only_new_tokens(vllm_a, hf_a, prompts, tok):
    """Three turns per sample in KV sessions: the same tokens and log-probs as the hf engine re-reading the whole
    context, while vLLM computes only each turn's new tokens (its scheduler's own count)."""
    assert vllm_a.keeps_sessions
    params = SamplingParams(max_tokens=12, temperature=0)
    observation = tok.encode(" <information> Doc 1 the river nile </information> ")
    keys = [f"s{i}" for i in range(len(prompts))]
    contexts = [list(p) for p in prompts]
    count, stop_counting = _scheduled(vllm_a)
    try:
        for turn in range(3):
            before = count[0]
            outs = vllm_a.generate(contexts, params, sessions=keys)
            assert_same(outs, hf_a.generate(contexts, params))
            new_tokens = 0
            for i, g in enumerate(outs):
                if turn:  # everything but the last sampled token and the observation is held by the session
                    assert g.num_cached_tokens == len(contexts[i]) - 1 - len(observation)
                new_tokens += len(contexts[i]) - g.num_cached_tokens + len(g.token_ids) - 1
            assert count[0] - before == new_tokens
            contexts = [c + g.token_ids + observation for c, g in zip(contexts, outs)]
    finally:
        stop_counting()
    vllm_a.end_sessions()
    assert not vllm_a.llm.llm_engine.has_unfinished_requests()  # ended sessions hold nothing
    # a prompt that does not extend its session's tokens starts a fresh request with the same result
    outs = vllm_a.generate(contexts[:2], params, sessions=keys[:2])
    other = vllm_a.generate([prompts[0]], params, sessions=keys[:1])
    assert_same(other, hf_a.generate([prompts[0]], params))
    assert_same(outs, hf_a.generate(contexts[:2], params))
    vllm_a.finish_weight_sync()  # ends the sessions (a prefix-cache reset with requests alive would fail)
    assert not vllm_a.llm.llm_engine.has_unfinished_requests()


@pytest.mark.slow
def test_vllm_sessions_stop_strings_spanning_tokens(vllm_a, prompts, tok):
    """Stop strings the tokenizer splits over several tokens, sampled: a session stops exactly where vLLM's own
    stop-string check stops a plain request, with the same tokens (seed_per_request: each session's own random
    stream goes on across the pauses at tokens that could complete a stop string but did not; with one stream per
    call a pause changes the batch of the next steps, hence the samples)."""
    vllm_a.seed_per_request = True
    try:
        _sessions_stop_like_plain_requests(vllm_a, prompts, tok)
    finally:
        vllm_a.seed_per_request = False


def _sessions_stop_like_plain_requests(vllm_a, prompts, tok):
    base = vllm_a.generate(prompts, SamplingParams(max_tokens=32, temperature=1.5, seed=3))
    stops = set()
    for g in base:  # the text of two tokens that appear mid-output: a stop string spanning a token boundary
        for k in range(4, len(g.token_ids) - 2, 5):
            text = tok.decode(g.token_ids[k:k + 2])
            if len(text.strip()) >= 3 and len(tok.encode(text, add_special_tokens=False)) >= 2:
                stops.add(text)
                break
    stops = tuple(sorted(stops))[:4]
    assert len(stops) >= 2, stops
    params = SamplingParams(max_tokens=32, temperature=1.5, seed=3, stop=stops)
    plain = vllm_a.generate(prompts * 3, params)
    pauses = vllm_a.session_pauses
    in_sessions = vllm_a.generate(prompts * 3, params, sessions=list(range(len(prompts) * 3)))
    vllm_a.end_sessions()
    assert vllm_a.session_pauses - pauses > 0  # tokens with a stop string's last character that completed none
    assert [(g.token_ids, g.finish_reason, g.stop_reason) for g in in_sessions] == \
        [(g.token_ids, g.finish_reason, g.stop_reason) for g in plain]
    for g, h in zip(in_sessions, plain):
        assert max(abs(x - y) for x, y in zip(g.logprobs, h.logprobs)) < 1e-4
    assert sum(g.finish_reason == "stop" for g in plain) >= 2  # the stop strings were hit, not just the limit


@pytest.mark.slow
def test_vllm_session_requests_hold_their_stop_ids_as_a_set(vllm_a, prompts):
    """vLLM's scheduler checks `token in stop_token_ids` after every token; a session request's candidates reach it
    as a frozenset (one lookup), not SamplingParams' list (a scan of every candidate)."""
    params = SamplingParams(max_tokens=4, temperature=0, stop=("</search>", "</answer>"), stop_token_ids=(0,))
    vllm_a.generate(prompts[:2], params, sessions=["a", "b"])
    sched = vllm_a.sessions.scheduler()
    held = [sched.requests[s.request_id] for s in vllm_a.sessions.held.values()]
    vllm_a.end_sessions()
    assert len(held) == 2
    for req in held:
        ids = req.sampling_params.stop_token_ids
        assert isinstance(ids, frozenset) and 0 in ids and ids == vllm_a.sessions.candidates(params.stop) | {0}


@pytest.mark.slow
def test_vllm_sessions_give_way_when_vllm_cannot_hold_them_all(vllm_a, hf_a, prompts):
    """A session paused between turns keeps its request slot: a call with more samples than slots runs as plain
    requests (with sessions it would wait forever for a slot), and other samples' sessions end to make room."""
    sched = vllm_a.llm.llm_engine.engine_core.engine_core.scheduler
    slots = sched.max_num_active_reqs
    sched.max_num_active_reqs = 3
    try:
        outs = vllm_a.generate(prompts, GREEDY, sessions=list(range(len(prompts))))  # 6 samples, 3 slots
        assert_same(outs, hf_a.generate(prompts, GREEDY))
        assert not vllm_a.sessions.held
        vllm_a.generate(prompts[:2], GREEDY, sessions=["a", "b"])
        assert set(vllm_a.sessions.held) == {"a", "b"}
        outs = vllm_a.generate(prompts[2:4], GREEDY, sessions=["c", "d"])  # 2 held + 2 new > 3 slots
        assert set(vllm_a.sessions.held) == {"c", "d"}
        assert_same(outs, hf_a.generate(prompts[2:4], GREEDY))
        # without that check the call would wait for a slot forever: the engine says so instead of hanging
        vllm_a.sessions.room = lambda *args: True
        with pytest.raises(RuntimeError, match="stopped making progress"):
            vllm_a.generate(prompts, GREEDY, sessions=list(range(len(prompts))))
    finally:
        vllm_a.sessions.__dict__.pop("room", None)
        vllm_a.end_sessions()
        sched.max_num_active_reqs = slots
    assert not vllm_a.llm.llm_engine.has_unfinished_requests()
    assert_same(vllm_a.generate(prompts, GREEDY), hf_a.generate(prompts, GREEDY))


@pytest.mark.slow
def test_vllm_under_torchrun_external_launcher(models, tmp_path):
    """2 ranks, Megatron initialised (gloo, tp=2), one vLLM engine per rank (vLLM TP=1) on different prompts."""
    from tests.dist_utils import run_torchrun

    if _vllm_importable():
        pytest.skip("vllm does not import")
    out = run_torchrun(os.path.join(HERE, "vllm_torchrun_script.py"), 2, models["A"], timeout=600)
    assert out.count("RANK_OK") == 2, out[-3000:]


# -- a checkpoint's padded vocabulary ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def padded(models, tok, tmp_path_factory):
    """Model A with 64 embedding rows past its tokenizer (as Qwen2.5 pads 151,665 ids to 152,064 rows), their output
    rows made the most likely of all: unmasked, sampling picks them at almost every step."""
    from transformers import AutoModelForCausalLM

    out = str(tmp_path_factory.mktemp("padded") / "A_padded")
    model = AutoModelForCausalLM.from_pretrained(models["A"])
    n = len(tok)
    model.resize_token_embeddings(n + 64, mean_resizing=False)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[n:] = 0.0
        head[n:, :] = 20.0 * model.model.norm.weight.sign()  # a large logit wherever the hidden state leans positive
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_hf_engine_never_samples_padded_rows(padded, tok, prompts):
    from megatron_searchr1.rollout.engines.vllm_engine import padded_vocabulary

    assert padded_vocabulary(padded, padded)
    outs = HFEngine(padded).generate(prompts, SamplingParams(max_tokens=16, temperature=1.0, seed=3))
    ids = [t for g in outs for t in g.token_ids]
    assert len(ids) == 16 * len(prompts) and max(ids) < len(tok)
    assert all(torch.isfinite(torch.tensor(g.logprobs)).all() for g in outs)


VLLM_PADDED = """
import json, os, sys
from safetensors.torch import load_file
from megatron_searchr1.rollout.engine import SamplingParams
from megatron_searchr1.rollout.engines import make_engine
# as the trainer starts it: random weights until the first weight sync
engine = make_engine("vllm", sys.argv[1], dtype="float32", kv_cache_gib=0.25, seed=0, load_format="dummy")
prompts = json.loads(sys.argv[2])
try:
    engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0))
    print("DUMMY generated", flush=True)
except RuntimeError as e:
    print("DUMMY refused: " + str(e), flush=True)
engine.load_weights(load_file(os.path.join(sys.argv[1], "model.safetensors")).items())
engine.finish_weight_sync()
outs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=1.0, seed=3))
greedy = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
print("IDS " + json.dumps([t for g in outs + greedy for t in g.token_ids]), flush=True)
engine.close()
"""


@pytest.mark.slow
def test_vllm_never_samples_padded_rows(padded, tok, prompts, hf_a):
    """vLLM cuts only its own TP padding: without the mask (rollout/engines/vllm_vocab_mask.py) these ids win.
    The engine starts as the trainer's does (load_format="dummy"): it refuses to generate until a weight sync."""
    import json
    import subprocess

    if _vllm_importable():
        pytest.skip("vllm does not import")
    proc = subprocess.run([sys.executable, "-c", VLLM_PADDED, padded, json.dumps(prompts)], capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("IDS ")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-4000:]
    ids = json.loads(lines[0][4:])
    assert len(ids) == 2 * 16 * len(prompts) and max(ids) < len(tok)
    assert "DUMMY refused: VLLMEngine.generate() on an engine without real weights" in proc.stdout, proc.stdout
    # after the sync the engine holds the checkpoint: greedy tokens as the hf engine's (whose mask is the same)
    greedy = ids[16 * len(prompts):]
    ref = [t for g in HFEngine(padded).generate(prompts, SamplingParams(max_tokens=16, temperature=0))
           for t in g.token_ids]
    assert greedy == ref
