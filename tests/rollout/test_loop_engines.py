"""The search loop end to end on the real engines and a real retrieval server.

A random tiny model would rarely emit `</search>`, so the model is built to follow a known path: with every
attention and MLP output projection zeroed, the residual stream is the current token's embedding, and the LM head
maps each token of the path to the next one (a bigram machine, greedy and deterministic on any engine):

    prompt's last token -> <think> T </think> <search> Q1 Q2 </search>      (stop; the loop searches "Q1 Q2")
    observation's last token -> <answer> A </answer>                        (stop; the sample answers)
"""
import json
import os
import subprocess
import sys

import pytest

from megatron_searchr1.data.prompts import format_observation
from megatron_searchr1.rollout.loop import LoopSettings, Trajectory, run_rollout


INFER_QUESTION = "who founded the city"


def _bigram_model(base_dir: str, out_dir: str, path: list[tuple[int, int]]):
    """Copy the HF model at base_dir with weights that send each `src` token to `dst` greedily."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    H = model.config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        emb = model.model.embed_tokens.weight
        head = model.lm_head.weight
        head.mul_(0.01)
        for dim, (src, dst) in enumerate(path):
            assert dim < H
            emb[src].zero_()
            emb[src, dim] = 1.0  # RMSNorm makes it sqrt(H) e_dim
            head[dst, dim] = 10.0
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model
    from megatron_searchr1.search.launch import ServerProcess

    root = tmp_path_factory.mktemp("loop_e2e")
    base = make_tiny_model(TinyModelConfig(output_dir=str(root / "base"), hidden_size=64, intermediate_size=128,
                                           num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=600,
                                           tie_embeddings=False))
    tok = AutoTokenizer.from_pretrained(base)
    one = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731

    question = one("Question: who founded the city?\n")
    # content tokens: single-token words of the vocabulary, distinct from everything else on the path; the prompt
    # ends with one of them, so its last token starts the path and appears nowhere else
    used = set(question) | {one(t)[0] for t in ("<think>", "</think>", "<search>", "</search>", "<answer>",
                                                "</answer>", "\n\n")}
    words = [i for i in range(len(tok)) if i not in used and tok.decode([i]).strip().isalpha()
             and len(tok.decode([i]).strip()) > 3][:5]
    W0, T, Q1, Q2, A = words
    prompt = question + [W0]
    query = tok.decode([Q1, Q2]).strip()
    corpus = root / "corpus.jsonl"
    with open(corpus, "w") as f:
        for i, text in enumerate([f"{query} is where the founder lived.", "An unrelated passage about rivers.",
                                  f"Another note on {query} and its history."]):
            f.write(json.dumps({"id": str(i), "contents": f'"Doc{i}"\n{text}'}) + "\n")
    subprocess.run([sys.executable, "-m", "megatron_searchr1.search.build_index", "--corpus", str(corpus), "--out-dir",
                    str(root / "index"), "--kind", "bm25", "--quiet"], check=True, capture_output=True, timeout=300)
    server = ServerProcess(["--index-dir", str(root / "index"), "--torch-threads", "1"]).start()
    try:
        from megatron_searchr1.search.client import RetrievalClient

        client = RetrievalClient(server.url, topk=2)
        docs = client.search([query])[0]
        obs = one(format_observation(docs))
        think, search, answer = one("<think>")[0], one("<search>")[0], one("<answer>")[0]
        path = [(prompt[-1], think), (think, T), (T, one("</think>")[0]), (one("</think>")[0], search),
                (search, Q1), (Q1, Q2), (Q2, one("</search>")[0]), (obs[-1], answer), (answer, A),
                (A, one("</answer>")[0])]
        sources = [s for s, _ in path]
        assert len(set(sources)) == len(sources), "path tokens must be distinct"
        model_dir = _bigram_model(base, str(root / "bigram"), path)
        # tools/infer.py renders its own prompt, which ends in a newline, as the observation does: a bigram model
        # cannot answer after one and search after the other, so the CLI's model searches after every newline
        # (one search turn, then a final turn that searches again: finish max_turns)
        from megatron_searchr1.data.prompts import make_prompt, normalize_question, render_prompt

        infer_last = one(render_prompt(make_prompt(normalize_question(INFER_QUESTION), "base"), tok, "auto"))[-1]
        assert infer_last == obs[-1]
        infer_model_dir = _bigram_model(base, str(root / "bigram_infer"), [(infer_last, think)] + path[1:7])
        yield dict(tok=tok, prompt=prompt, model_dir=model_dir, client=client, obs=obs, query=query,
                   answer_text=tok.decode([A]).strip(), infer_model_dir=infer_model_dir)
        client.close()
    finally:
        server.stop()


def _run(engine, s):
    traj = Trajectory(prompt_ids=list(s["prompt"]), uid="q")
    settings = LoopSettings(max_turns=2, max_tokens_per_turn=16, max_response_length=400, max_obs_length=300,
                            temperature=0.0)
    run_rollout(engine, s["tok"], s["client"].search, [traj], settings)
    return traj


def _check(traj, s):
    tok = s["tok"]
    assert traj.finish_reason == "answer" and traj.queries == [s["query"]] and traj.answer == s["answer_text"]
    first = traj.loss_mask.index(0)
    n_obs = len(s["obs"])
    # the <information> tokens are exactly the tokenized server result, with loss mask 0
    assert traj.response_ids[first: first + n_obs] == s["obs"]
    assert traj.loss_mask[first: first + n_obs] == [0] * n_obs
    # each generated turn ends at its stop tag: nothing after </search> or </answer>
    assert tok.decode(traj.response_ids[:first]).endswith("</search>")
    assert tok.decode(traj.response_ids[first + n_obs:]).endswith("</answer>")
    assert traj.loss_mask[first + n_obs:] == [1] * (len(traj.response_ids) - first - n_obs)


def test_hf_engine_runs_the_loop_against_the_server(setup):
    from megatron_searchr1.rollout.engines import make_engine

    traj = _run(make_engine("hf", setup["model_dir"]), setup)
    _check(traj, setup)


@pytest.mark.slow
def test_vllm_engine_gives_the_hf_engines_tokens(setup):
    pytest.importorskip("vllm")
    import bm25s  # noqa: F401 - imports numba, hence llvmlite, which vLLM's CPU start-up trips over unless hidden
    assert "llvmlite" in sys.modules
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from megatron_searchr1.rollout.engines import make_engine

    engine = make_engine("vllm", setup["model_dir"], dtype="float32", kv_cache_gib=0.25, max_model_len=1024)
    try:
        vllm_traj = _run(engine, setup)
        _check(vllm_traj, setup)
        # seeded sampling over more prompt tokens than one engine step takes: vLLM 0.32 crashed on the CPU when a
        # request with its own seed (seed_per_request) had its prefill chunked ("CPU Generator does not use
        # offset"); the engine prefills whole. Both seeding modes.
        from megatron_searchr1.rollout.engine import SamplingParams

        for per_request in (True, False):
            engine.seed_per_request = per_request
            outs = engine.generate([[setup["prompt"][0]] * 900] * 12,
                                   SamplingParams(max_tokens=4, temperature=1.0, seed=3))
            assert [len(o.token_ids) for o in outs] == [4] * 12
        engine.seed_per_request = False
    finally:
        engine.close()  # vLLM's own process group goes with it
    hf_traj = _run(make_engine("hf", setup["model_dir"]), setup)
    assert vllm_traj.response_ids == hf_traj.response_ids
    assert vllm_traj.loss_mask == hf_traj.loss_mask
    gen = [i for i, m in enumerate(vllm_traj.loss_mask) if m]
    assert max(abs(vllm_traj.logprobs[i] - hf_traj.logprobs[i]) for i in gen) < 1e-4


def test_infer_cli_prints_the_trajectory_turn_by_turn(setup):
    from megatron_searchr1.trainer.reports import turn_segments
    from megatron_searchr1.rollout.engines import make_engine
    from tests.dist_utils import REPO

    proc = subprocess.run([sys.executable, "tools/infer.py", "--model", setup["infer_model_dir"], "--engine", "hf",
                           "--url", setup["client"].base_url, "--question", INFER_QUESTION,
                           "--max-turns", "1", "--max-tokens-per-turn", "8"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.startswith("[prompt]\n") and "Question: who founded the city?" in out and "[model]" in out
    assert "[finish]" in out.splitlines()[-1]
    # the search ran: a [context] block holds the retrieved documents (not a failed search's text); the final turn
    # searched again (the infer model's path, see setup), which ends the sample max_turns
    context = out.split("[context]\n", 1)[1].split("\n[model]", 1)[0]
    assert "<information>" in context and "Doc 1(Title: " in context, out
    assert f"{setup['query']} is where the founder lived." in context and "Search failed" not in context
    assert out.splitlines()[-1] == "[finish] max_turns; searches: 1; answer: None", out
    # segments alternate between what the model wrote and what was appended
    traj = _run(make_engine("hf", setup["model_dir"]), setup)
    kinds = [k for k, _ in turn_segments(setup["tok"], traj)]
    assert kinds == ["model", "context", "model"]
