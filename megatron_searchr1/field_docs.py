"""The one-line docs of a dataclass's fields, read from its source: a leaf (stdlib only) shared by the trainer's
`--help-config` (config/loader.py) and the retrieval server's flags (search/server.py), so that the server, a
service of its own, does not import the trainer's configuration loader."""
from __future__ import annotations

import ast
import inspect


def field_docs(cls) -> dict[str, str]:
    """{field name: docstring} of a dataclass: the string literal right after each annotated assignment ({} when
    the source cannot be read, e.g. a class made at run time)."""
    docs: dict[str, str] = {}
    try:
        body = ast.parse(inspect.getsource(cls)).body[0].body
    except (OSError, TypeError):
        return docs
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value)
    return docs
