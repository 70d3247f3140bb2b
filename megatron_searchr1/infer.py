r"""Ask a trained model a question with a live retrieval server, and watch it search, turn by turn.

    python tools/infer.py --model runs/demo/rl/hf --url http://127.0.0.1:8000 \
        --question "In which year was the university attended by the CEO of Quorvin Labs founded?"
    python tools/infer.py --model runs/demo/rl/checkpoints ...      # a Megatron checkpoint (converted first)
    python tools/infer.py --model DIR --protocol tool_calls --tools search,open --question "..."   # native tool calls
    python tools/infer.py --model DIR --protocol tool_calls --tool-parser auto \
        --chat-template-kwargs '{"enable_thinking": false}' --question "..."      # Qwen3, thinking off

Runs the same rollout loop as training (rollout/loop.py) on vLLM (`--engine hf` for the transformers reference),
greedy by default, and prints each generated turn and each observation as it was appended to the context.
`--protocol tool_calls`: the model's own chat template with the tools' schemas, calls in its own format, results as
the template's tool messages (rollout/protocols/tool_calls.py); search results carry the document ids `open` takes.
Give it the settings the model was trained with (rollout.tool_parser, rollout.chat_template_kwargs).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Optional, Sequence

from megatron_searchr1.cli import ArgumentParser, UsageError, run_main
from megatron_searchr1.console import quiet_third_party_warnings
from megatron_searchr1.data.prompts import TEMPLATES


def _resolve_model(path: str, workdir: str) -> str:
    """An HF dir as is; a Megatron checkpoint (converter's, or a run's checkpoints root) converted to HF first."""
    from megatron_searchr1.models.convert_megatron import megatron_to_hf
    from megatron_searchr1.trainer.sources import resolve_model_source

    if os.path.isfile(os.path.join(path, "config.json")) and any(
            f.endswith(".safetensors") or f.endswith(".index.json") for f in os.listdir(path)):
        return path
    src = resolve_model_source(path)
    if not os.path.isfile(os.path.join(src, "metadata.json")):
        raise UsageError(f"--model {path!r} is neither a Hugging Face model dir nor a Megatron checkpoint")
    out = os.path.join(workdir, "hf")
    megatron_to_hf(src, out, overwrite=True)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    quiet_third_party_warnings()  # torch / Megatron / vLLM deprecation noise; ours still shows
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model dir, or a Megatron checkpoint dir / run checkpoints root")
    p.add_argument("--question", required=True, help="the question to answer")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="retrieval server")
    p.add_argument("--topk", type=int, default=3, help="passages per search")
    p.add_argument("--engine", default="vllm", choices=["vllm", "hf"], help="generation engine")
    p.add_argument("--max-turns", type=int, default=4, help="search turns before the final answer turn")
    p.add_argument("--max-tokens-per-turn", type=int, default=500, help="tokens generated per turn at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--template", default="base", choices=list(TEMPLATES),
                   help="prompt template the model was trained with (data/prompts.py; the CPU demo's is short)")
    p.add_argument("--chat-template", default="auto", choices=["auto", "always", "never"],
                   help="render through the tokenizer's chat template (auto: when it has one)")
    p.add_argument("--protocol", default="search_r1", choices=["search_r1", "tool_calls"],
                   help="how the model calls tools: Search-R1's tags, or its chat template's tool calls")
    p.add_argument("--tools", default="search,open", help="tool_calls: comma list of built-in tools (search, open)")
    p.add_argument("--tool-parser", default="hermes",
                   help="tool_calls: the format the model writes calls in (rollout.tool_parser): hermes, qwen3_coder, "
                        "glm45, llama3_json, mistral, or auto (picked from the chat template)")
    p.add_argument("--chat-template-kwargs", default="{}",
                   help='tool_calls: a JSON object of extra chat-template variables for every render '
                        '(rollout.chat_template_kwargs), e.g. \'{"enable_thinking": false}\'')
    a = p.parse_args(argv)
    specs = ()
    try:
        template_kwargs = json.loads(a.chat_template_kwargs)
    except json.JSONDecodeError as e:
        raise UsageError(f"--chat-template-kwargs is not JSON ({e.msg}): pass an object, e.g. "
                         "'{\"enable_thinking\": false}'") from None
    if not isinstance(template_kwargs, dict) or not all(
            v is None or isinstance(v, (bool, int, float, str)) for v in template_kwargs.values()):
        raise UsageError("--chat-template-kwargs must be a JSON object of scalars, e.g. '{\"enable_thinking\": false}'")
    if a.protocol == "tool_calls":
        from megatron_searchr1.config.tools import TOOL_PARSERS, tool_specs

        try:
            specs = tool_specs([t.strip() for t in a.tools.split(",") if t.strip()])
        except ValueError as e:
            raise UsageError(f"--tools: {e}") from None
        if not specs or a.tool_parser not in TOOL_PARSERS:
            raise UsageError(f"--tools names at least one tool and --tool-parser one of {', '.join(TOOL_PARSERS)}")
    if not os.path.isdir(a.model):
        raise UsageError(f"--model {a.model!r} does not exist")
    if a.max_turns < 0 or a.max_tokens_per_turn < 1 or a.topk < 1 or a.temperature < 0:
        raise UsageError("--max-turns >= 0, --max-tokens-per-turn >= 1, --topk >= 1 and --temperature >= 0")
    from megatron_searchr1.search.client import RetrievalClient

    client = RetrievalClient(a.url, topk=a.topk, max_retries=0, doc_ids=a.protocol == "tool_calls")
    try:
        client.health()
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"no retrieval server at {a.url} ({type(e).__name__}): start one with "
                         "python -m megatron_searchr1.search.server --index-dir DIR --port 8000") from None

    import tempfile

    from transformers import AutoTokenizer

    from megatron_searchr1.data.prompts import make_prompt, normalize_question, render_prompt
    from megatron_searchr1.rollout.engines import make_engine
    from megatron_searchr1.rollout.loop import LoopSettings, Trajectory, run_rollout
    from megatron_searchr1.rollout.protocols import ProtocolSpec, build_protocol
    from megatron_searchr1.rollout.protocols.tool_calls import tool_calls_messages
    from megatron_searchr1.trainer.reports import turn_segments
    from megatron_searchr1.trainer.sources import stop_token_ids

    with tempfile.TemporaryDirectory() as work:
        model_dir = _resolve_model(a.model, work)
        tok = AutoTokenizer.from_pretrained(model_dir)
        spec = ProtocolSpec(a.protocol, a.tool_parser, specs, tools_url=client.base_url,
                            chat_template_kwargs=tuple(sorted(template_kwargs.items())))
        if a.protocol == "tool_calls":
            try:
                prompt = build_protocol(spec, tok).render_prompt(tool_calls_messages(normalize_question(a.question)))
            except ValueError as e:
                raise UsageError(f"--model {a.model}: {e}") from None
        else:
            prompt = render_prompt(make_prompt(normalize_question(a.question), a.template), tok, a.chat_template)
        ids = tok.encode(prompt, add_special_tokens=False)
        kw = {"dtype": "float32", "max_model_len": len(ids) + (a.max_turns + 1) * (a.max_tokens_per_turn + 600)}
        engine = make_engine(a.engine, model_dir, **(kw if a.engine == "vllm" else {}))
        traj = Trajectory(prompt_ids=ids, uid="infer")
        settings = LoopSettings(max_turns=a.max_turns, max_tokens_per_turn=a.max_tokens_per_turn,
                                max_response_length=(a.max_turns + 1) * (a.max_tokens_per_turn + 600),
                                temperature=a.temperature, stop_token_ids=stop_token_ids(tok, model_dir),
                                protocol_spec=spec)
        run_rollout(engine, tok, client.search, [traj], settings)
    print(f"[prompt]\n{prompt}")
    for kind, text in turn_segments(tok, traj):
        print(f"[{kind}]\n{text.strip()}\n")
    calls = f"tool calls: {traj.n_tool_calls}; " if a.protocol == "tool_calls" else ""
    print(f"[finish] {traj.finish_reason}; searches: {traj.n_searches}; {calls}answer: {traj.answer!r}")
    return 0


def cli() -> int:
    """Console-script entry: user mistakes become one `error:` line and exit code 2."""
    return run_main(main)


if __name__ == "__main__":
    sys.exit(cli())
