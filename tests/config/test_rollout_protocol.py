"""rollout.protocol and the tool fields: YAML tool declarations, messages that say what to change, the loop's spec."""
import pytest

from megatron_searchr1.config import ConfigError, load_config, save_config
from megatron_searchr1.rollout.loop import settings_from_config


def test_search_r1_is_the_default_and_tool_calls_reads_declared_tools(tmp_path):
    cfg = load_config(None, [])
    assert cfg.rollout.protocol == "search_r1"
    assert settings_from_config(cfg.rollout, [], None)[0].protocol_spec.tools == ()
    path = tmp_path / "exp.yaml"
    path.write_text("rollout:\n  protocol: tool_calls\n  max_invalid_calls: 2\n  tools:\n    - search\n"
                    "    - {name: open, options: {max_chars: 300}}\n"
                    "    - name: calc\n      description: Add two numbers.\n      endpoint: python:my_tools:add\n"
                    "      parameters: {type: object, properties: {a: {type: number}}, required: [a]}\n")
    cfg = load_config(str(path), ["rollout.tool_timeout=5"])
    train, val = settings_from_config(cfg.rollout, [7], 3, tools_url="http://127.0.0.1:8000")
    spec = train.protocol_spec
    assert spec == val.protocol_spec and (spec.name, spec.max_invalid_calls, spec.tool_timeout) == ("tool_calls", 2, 5)
    assert [t.name for t in spec.tools] == ["search", "open", "calc"] and spec.tools[1].options == {"max_chars": 300}
    assert spec.tools[2].endpoint == "python:my_tools:add" and spec.tools_url == "http://127.0.0.1:8000"
    save_config(cfg, str(tmp_path / "saved.yaml"))
    assert load_config(str(tmp_path / "saved.yaml")) == cfg


@pytest.mark.parametrize("overrides, message", [
    (["rollout.protocol=tools"], "rollout.protocol must be search_r1 or tool_calls"),
    (["rollout.protocol=tool_calls", "rollout.tool_parser=qwen9"], "rollout.tool_parser must be one of hermes"),
    (["rollout.protocol=tool_calls", "rollout.tools=[browse]"], "unknown built-in tool 'browse'"),
    (["rollout.protocol=tool_calls", "rollout.tools=[]"], "needs at least one tool"),
    (["rollout.max_invalid_calls=0"], "rollout.max_invalid_calls must be >= 1"),
    (["rollout.protocol=tool_calls", "rollout.chat_template_kwargs={x: [1]}"],
     "rollout.chat_template_kwargs must map names to scalars"),
])
def test_bad_protocol_settings_say_what_to_change(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_chat_template_kwargs_and_the_parser_reach_the_loops_spec(tmp_path):
    cfg = load_config(None, ["rollout.protocol=tool_calls", "rollout.tool_parser=llama3_json",
                             "rollout.chat_template_kwargs={enable_thinking: false, date_string: 1 Jan 2026}"])
    spec = settings_from_config(cfg.rollout, [], None)[0].protocol_spec
    assert spec.tool_parser == "llama3_json"
    assert spec.chat_template_kwargs == (("date_string", "1 Jan 2026"), ("enable_thinking", False))
    hash(spec)  # LoopSettings carries it
    save_config(cfg, str(tmp_path / "saved.yaml"))
    assert load_config(str(tmp_path / "saved.yaml")) == cfg
