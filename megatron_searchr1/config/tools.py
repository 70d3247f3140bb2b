"""Tool declarations (`rollout.tools`): what a tool-calling policy sees of a tool (name, description, JSON schema) and
where its calls go. Stdlib only: the config checks them before anything is built; rollout/protocols/tools.py runs
them (its docstring has the endpoint contract)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

TOOL_PARSERS = ("hermes", "qwen3_coder", "glm45", "llama3_json", "mistral", "auto")
"""The call formats rollout/protocols/parsers.py reads (rollout.tool_parser; auto: picked from the chat template)."""


@dataclass(frozen=True)
class ToolSpec:
    """One tool: what the model sees (name, description, JSON schema) and where its calls go."""

    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    """The arguments' JSON schema (an object schema)."""
    endpoint: str = ""
    """search | http(s)://... | /path (on the retrieval server) | python:module:function."""
    options: dict = field(default_factory=dict)
    """Sent with every HTTP request beside the arguments (e.g. `max_chars`, the open tool's length budget)."""

    def schema(self) -> dict:
        """The OpenAI-style function schema chat templates take (`tools=` in apply_chat_template)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def __hash__(self):
        return hash((self.name, self.endpoint, json.dumps(self.parameters, sort_keys=True)))


BUILTIN: dict[str, ToolSpec] = {
    "search": ToolSpec(
        "search", "Search the knowledge source; returns the top passages, each with its document id.",
        {"type": "object", "properties": {"query": {"type": "string", "description": "what to search for"}},
         "required": ["query"]},
        endpoint="search"),
    "open": ToolSpec(
        "open", "Open a document a search returned, by its id: its text from `offset` (characters), up to a length "
                "budget.",
        {"type": "object", "properties": {
            "doc_id": {"type": "string", "description": "the id a search result carried"},
            "offset": {"type": "integer", "description": "first character to read (default 0)", "minimum": 0}},
         "required": ["doc_id"]},
        endpoint="/open", options={"max_chars": 1000}),
}


def tool_specs(items: Sequence[Any]) -> tuple[ToolSpec, ...]:
    """ToolSpecs from the config's `rollout.tools` (names of built-ins, or dicts); ValueError says what to change."""
    out = []
    for i, item in enumerate(items):
        where = f"rollout.tools[{i}]"
        if isinstance(item, str):
            if item not in BUILTIN:
                raise ValueError(f"{where}: unknown built-in tool {item!r} (built-ins: {', '.join(BUILTIN)}); declare "
                                 "your own as {name, description, parameters, endpoint}")
            out.append(BUILTIN[item])
            continue
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            raise ValueError(f"{where}: a tool is a built-in's name or a mapping with a `name`, got {item!r}")
        unknown = set(item) - {"name", "description", "parameters", "endpoint", "options"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; a tool has name, description, parameters, "
                             "endpoint, options")
        base = BUILTIN.get(item["name"])
        spec = ToolSpec(item["name"], item.get("description", base.description if base else ""),
                        item.get("parameters", base.parameters if base else {"type": "object", "properties": {}}),
                        item.get("endpoint", base.endpoint if base else ""),
                        {**(base.options if base else {}), **item.get("options", {})})
        if not spec.endpoint:
            raise ValueError(f"{where} ({spec.name}): say where its calls go: endpoint: search | http://HOST/PATH | "
                             "/path (on the retrieval server) | python:module:function")
        if not (spec.endpoint == "search" or spec.endpoint.startswith(("http://", "https://", "/", "python:"))):
            raise ValueError(f"{where} ({spec.name}): endpoint {spec.endpoint!r} is none of search, http(s)://..., "
                             "/path, python:module:function")
        if not isinstance(spec.parameters, dict) or spec.parameters.get("type", "object") != "object":
            raise ValueError(f"{where} ({spec.name}): parameters must be a JSON schema of type object")
        out.append(spec)
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise ValueError(f"rollout.tools: a name appears twice: {names}")
    return tuple(out)


