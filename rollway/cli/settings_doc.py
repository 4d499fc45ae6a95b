"""The ``ROLLWAY_*`` settings listed under ``rollway --help``, read from the source of ``rollway.settings``.

``rollway.settings.settings_rows`` lists them from the pydantic ``Settings`` class, and importing that class
costs pydantic, pydantic-settings (and asyncio under it), PyYAML and the store's schemas: several times what the
rest of ``rollway --help`` costs. Help needs only each field's name, description and default, plain expressions
in the class body: this reads them with ``ast`` and gives the same rows. Anything it does not understand (a
field not declared as ``Field(...)``, a default that names a constant, ...) falls back to ``settings_rows``
itself, so the help is never wrong, only slower; ``tests/cli/test_cli.py`` checks that both agree.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Any

TITLE = "Settings (environment variables; also keys of the --config YAML file)"

# the names a default may be made of (``default_factory=dict``); nothing is called but a default factory
_SAFE_NAMES: dict[str, Any] = {"dict": dict, "list": list, "set": set, "tuple": tuple, "None": None}


def settings_rows() -> list[tuple[str, str]]:
    """Every setting as its environment variable and its description with its default."""
    try:
        return rows_from_source()
    except Exception:  # a shape this reader does not know: ask the class itself
        from rollway.settings import settings_rows as from_class

        return from_class()


def rows_from_source() -> list[tuple[str, str]]:
    """``rollway.settings.settings_rows()``, read from the source without importing it; ValueError (or
    LookupError) for a declaration it does not understand."""
    spec = importlib.util.find_spec("rollway.settings")
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise LookupError("rollway.settings has no source file")
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"), spec.origin)
    [cls] = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Settings"]
    rows = []
    for statement in cls.body:
        if isinstance(statement, ast.Assign | ast.AnnAssign) and _is_config(statement):
            continue
        if not isinstance(statement, ast.AnnAssign):
            if isinstance(statement, ast.Assign):
                raise ValueError("a class attribute without an annotation")
            continue  # methods, the docstring
        if not isinstance(statement.target, ast.Name):
            raise ValueError("a setting that is not a plain name")
        name = statement.target.id
        call = statement.value
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "Field"):
            raise ValueError(f"setting {name} is not declared with Field(...)")
        if call.args or any(keyword.arg is None for keyword in call.keywords):
            raise ValueError(f"setting {name} gives Field positional or ** arguments")
        keywords = {keyword.arg: keyword.value for keyword in call.keywords}
        description = _evaluate(keywords["description"]) if "description" in keywords else None
        if "default" in keywords:
            value = _evaluate(keywords["default"])
        elif "default_factory" in keywords:
            value = _evaluate(keywords["default_factory"])()
        else:
            raise ValueError(f"setting {name} has no default")
        default = "unset" if value is None else repr(value)
        rows.append((f"ROLLWAY_{name.upper()}", f"{description or ''} [default: {default}]".lstrip()))
    return rows


def _is_config(statement: ast.Assign | ast.AnnAssign) -> bool:
    targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
    return any(isinstance(target, ast.Name) and target.id == "model_config" for target in targets)


def _evaluate(node: ast.expr) -> Any:
    """The value of a constant expression of the class body (``"text"``, ``256 * 1024 * 1024``, ``dict``)."""
    for child in ast.walk(node):
        if isinstance(child, ast.Name) and child.id not in _SAFE_NAMES:
            raise ValueError(f"{child.id} is not a constant")
        if isinstance(child, ast.Call | ast.Attribute | ast.Lambda | ast.NamedExpr | ast.Subscript):
            raise ValueError("not a constant expression")
    code = compile(ast.Expression(node), "<rollway.settings>", "eval")
    return eval(code, {"__builtins__": {}}, dict(_SAFE_NAMES))
