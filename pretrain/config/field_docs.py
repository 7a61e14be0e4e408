"""Each config field's one-line docstring, read from `schema.py` (the string literal under the field).

    python -m pretrain.config.field_docs        # every key: type, default, docstring

Python keeps no attribute docstrings at run time, so they are read from the class source with `ast`.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from functools import lru_cache
from typing import Dict

from pretrain.config.schema import SECTIONS


@lru_cache(maxsize=None)
def field_docs(cls: type) -> Dict[str, str]:
    """{field name: docstring} of a schema dataclass (fields without one are absent)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = after.value.value.strip()
    return docs


def reference() -> str:
    """Every `section.key` with its type, default and docstring, one block per section."""
    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"{section}:")
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            tp = hints[f.name]
            kind = tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")
            lines.append(f"  {f.name}: {default!r}  # {kind}\n      {docs.get(f.name, '')}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference())
