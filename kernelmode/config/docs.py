"""The settings' descriptions, for the generated reference: each key's ``Field(description=...)``,
else its attribute docstring (the string right below its declaration).

Read from the source on demand, not at every start: pydantic's ``use_attribute_docstrings``
parses each model's module at class creation (~40 ms of every `kernelmode` start for the
settings' twenty models), and only the reference and its tests read the descriptions.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from pydantic import BaseModel


def _attribute_docstrings(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (a built-in, or a class made at run time)
        return {}
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    docs: dict[str, str] = {}
    for node, below in zip(body.body, body.body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(below, ast.Expr) and isinstance(below.value, ast.Constant)
                and isinstance(below.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(below.value.value)
    return docs


def field_descriptions(model: type[BaseModel]) -> dict[str, str]:
    """Each field's description (its ``description=``, else its attribute docstring; a subclass's
    wins over its base's); a field with neither is left out."""
    out = {name: f.description for name, f in model.model_fields.items() if f.description}
    for cls in model.__mro__:
        if issubclass(cls, BaseModel) and cls is not BaseModel:
            for name, doc in _attribute_docstrings(cls).items():
                if name in model.model_fields:
                    out.setdefault(name, doc)
    return out
