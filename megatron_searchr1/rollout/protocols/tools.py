"""The tools a tool-calling policy may call: declared in the config, checked, run in batches per turn.

    rollout.tools: [search, open]                       # the built-in tools, by name
    rollout.tools:                                      # or declared: name, JSON schema, where calls go
      - search
      - {name: open, options: {max_chars: 800}}         # a built-in with other options
      - name: calc
        description: Evaluate an arithmetic expression.
        parameters: {type: object, properties: {expr: {type: string}}, required: [expr]}
        endpoint: python:my_tools:calc                 # fn(**arguments) -> str
      - {name: weather, parameters: {...}, endpoint: "http://127.0.0.1:9000/weather"}

Where a call goes (`endpoint`):
- ``search``: the rollout's searcher, i.e. the retrieval server's `/retrieve` through the trainer's failure guard
  (a dead retriever stops the run as it does under Search-R1's protocol). Arguments `{"query": str}`.
- ``http://...`` or ``/path`` (a path on the retrieval server, e.g. the built-in `open` tool's `/open`): one POST per
  tool per turn with every call of the turn, `{"arguments": [{...}, ...], **options}`, answered
  `{"results": [str, ...]}` (one text per call, in order).
- ``python:module:function``: `function(**arguments) -> str`, called once per call.

A call that cannot run (unknown tool, unreadable JSON, arguments that do not match the tool's schema) is answered
with an error observation (`Error: ...`) and counted as an invalid call; a tool that fails (HTTP error, an exception in
the function) is answered `Tool failed: ...` (`is_tool_failure`), like a failed search.
"""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from megatron_searchr1.config.tools import BUILTIN, ToolSpec, tool_specs  # noqa: F401  (re-exported)
from megatron_searchr1.rollout.protocols.parsers import ToolCall
from megatron_searchr1.search.client import is_search_failure

_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}


def check_arguments(schema: dict, args: dict, where: str = "") -> Optional[str]:
    """Why `args` do not match the object schema `schema` (required keys, property types, enums, minimums, unknown
    keys when additionalProperties is false; nested objects and array items alike), or None.

    >>> check_arguments(BUILTIN["open"].parameters, {"doc_id": "7", "offset": 3}) is None
    True
    >>> check_arguments(BUILTIN["open"].parameters, {"offset": 3})
    "missing required argument 'doc_id'"
    >>> check_arguments(BUILTIN["search"].parameters, {"query": 5})
    "argument 'query' must be a string, got 5"
    >>> nested = {"type": "object", "properties": {"where": {"type": "object", "required": ["unit"],
    ...           "properties": {"unit": {"type": "string", "enum": ["km", "mi"]}}}}}
    >>> print(check_arguments(nested, {"where": {"unit": "m"}}))
    argument 'where.unit' must be one of ['km', 'mi'], got "m"
    """
    props = schema.get("properties", {}) or {}
    for key in schema.get("required", []) or []:
        if key not in args:
            return f"missing required argument {where + key!r}"
    for key, value in args.items():
        name = where + key
        if key not in props:
            if schema.get("additionalProperties") is False:
                return f"unknown argument {name!r} (arguments: {', '.join(props) or 'none'})"
            continue
        why = _check_value(props[key] or {}, value, name)
        if why:
            return why
    return None


def _check_value(p: dict, value, name: str) -> Optional[str]:
    kind = p.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind else []
    if kinds and not any(isinstance(value, _TYPES.get(k, object)) and not (k in ("integer", "number")
                                                                           and isinstance(value, bool))
                         for k in kinds):
        return f"argument {name!r} must be {'an' if kinds[0][0] in 'aeiou' else 'a'} {' or '.join(kinds)}, " \
               f"got {json.dumps(value)}"
    if "enum" in p and value not in p["enum"]:
        return f"argument {name!r} must be one of {p['enum']}, got {json.dumps(value)}"
    if "minimum" in p and isinstance(value, (int, float)) and value < p["minimum"]:
        return f"argument {name!r} must be >= {p['minimum']}, got {value}"
    if isinstance(value, dict) and ("properties" in p or "required" in p):
        return check_arguments(p, value, name + ".")
    if isinstance(value, list) and isinstance(p.get("items"), dict):
        for i, item in enumerate(value):
            why = _check_value(p["items"], item, f"{name}[{i}]")
            if why:
                return why
    return None


def is_tool_failure(text: str) -> bool:
    """A tool that failed to answer (not the model's fault), as a failed search is."""
    return is_search_failure(text) or text.startswith(TOOL_FAILED)


TOOL_FAILED = "Tool failed: "
INVALID = "Error: "


@dataclass
class Outcome:
    """What one call gave."""

    text: str
    """The observation: the tool's result, `Error: ...` (invalid call) or `Tool failed: ...`."""
    status: str
    """ok | invalid | failed"""


class ToolBox:
    """The configured tools. `run(calls, search)` runs every call of a turn (for all trajectories at once): the
    search calls in ONE call of the rollout's searcher, each HTTP tool's calls in one request, Python tools one by
    one. `base_url` resolves `/path` endpoints (the retrieval server)."""

    def __init__(self, specs: Sequence[ToolSpec], base_url: Optional[str] = None, timeout: float = 60.0):
        self.specs = {s.name: s for s in specs}
        self.base_url = base_url.rstrip("/") if base_url else None
        if self.base_url and self.base_url.endswith("/retrieve"):
            self.base_url = self.base_url[: -len("/retrieve")]
        self.timeout = timeout
        self._functions: dict[str, Callable] = {}
        self._http = None

    def schemas(self) -> list[dict]:
        return [s.schema() for s in self.specs.values()]

    def validate(self, call: ToolCall) -> ToolCall:
        """`call` with `error` set when it cannot run here."""
        if call.error is None:
            spec = self.specs.get(call.name)
            if spec is None:
                call.error = f"unknown tool {call.name!r}; the tools are {', '.join(self.specs)}"
            else:
                call.error = check_arguments(spec.parameters, call.arguments or {})
        return call

    def run(self, calls: Sequence[ToolCall], search: Callable[[list[str]], list[str]]) -> list[Outcome]:
        """One Outcome per call, in order. When the rollout runs on several ranks of one engine (engine_tp > 1),
        every rank holds the same trajectories and runs this with the same calls: the search goes through `search`
        (which asks on the engine's first rank and shares the results), and the other tools' calls run inside
        `search.once(fn)` when the searcher has it (fn on the engine's first rank, its result on every rank), so a
        tool with side effects or a cost is called once per engine, not once per rank."""
        out: list[Optional[Outcome]] = [None] * len(calls)
        by_tool: dict[str, list[int]] = {}
        for i, c in enumerate(calls):
            self.validate(c)
            if c.error is not None:
                out[i] = Outcome(INVALID + c.error, "invalid")
            else:
                by_tool.setdefault(c.name, []).append(i)
        texts: dict[str, list] = {}
        for name, idx in by_tool.items():
            if self.specs[name].endpoint == "search":  # the searcher never raises but to stop the run
                args = [calls[i].arguments for i in idx]
                texts[name] = list(search([str(a["query"]).strip() for a in args]))
                if len(texts[name]) != len(idx):
                    raise RuntimeError(f"search returned {len(texts[name])} results for {len(idx)} queries")
        others = {name: [calls[i].arguments for i in idx] for name, idx in by_tool.items() if name not in texts}
        if others:  # one round per turn for all other tools (a collective when `once` shares it)
            once = getattr(search, "once", None)
            texts.update(once(lambda: self._call_all(others)) if once is not None else self._call_all(others))
        for name, idx in by_tool.items():
            for i, text in zip(idx, texts[name]):
                text = text if isinstance(text, str) else json.dumps(text, ensure_ascii=False)
                out[i] = Outcome(text, "failed" if is_tool_failure(text) else "ok")
        return out  # type: ignore[return-value]

    def _call_all(self, args_of: dict[str, list[dict]]) -> dict[str, list]:
        """Every non-search tool's calls of a turn -> their results; a tool's failure is its calls' observation."""
        out = {}
        for name, args in args_of.items():
            try:
                got = self._call(self.specs[name], args)
                if len(got) != len(args):
                    raise RuntimeError(f"{len(got)} results for {len(args)} calls")
            except Exception as e:  # noqa: BLE001 - a tool's failure is an observation, the run goes on
                got = [TOOL_FAILED + f"{name}: {type(e).__name__}: {e}"] * len(args)
            out[name] = got
        return out

    def _call(self, spec: ToolSpec, args: list[dict]) -> list[str]:
        ep = spec.endpoint
        if ep.startswith("python:"):
            fn = self._functions.get(ep)
            if fn is None:
                module, _, attr = ep[len("python:"):].partition(":")
                fn = self._functions[ep] = getattr(importlib.import_module(module), attr)
            return [str(fn(**a)) for a in args]
        url = ep
        if ep.startswith("/"):
            if not self.base_url:
                raise RuntimeError(f"tool {spec.name} goes to {ep} on the retrieval server, but no server URL is known")
            url = self.base_url + ep
        if self._http is None:
            import httpx

            self._http = httpx.Client(timeout=self.timeout)
        r = self._http.post(url, json={"arguments": args, **spec.options})
        if r.status_code != 200:
            detail = r.text[:200]
            raise RuntimeError(f"HTTP {r.status_code} from {url}: {detail}")
        results = r.json().get("results")
        if not isinstance(results, list):
            raise RuntimeError(f"{url} answered without a `results` list")
        return results


