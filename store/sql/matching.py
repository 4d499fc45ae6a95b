"""Rollouts picked by their task's mode, group and metadata: the filters of a claim (``queue.claim``) and of an
export (``exports``).

A metadata filter ``{"step": 3, "split": "a"}`` holds for a rollout whose task metadata has each key at that
value. Values are JSON scalars (a string, a finite number, true or false), and both engines compare them as JSON
values, by type and then by value: ``3`` matches ``3`` and ``3.0``; ``true`` matches only ``true`` (not ``1``);
``"3"`` matches only the string. SQLite reads the stored value's JSON type (``json_type``) beside the value
(``json_extract``, which alone would read ``true`` as ``1``); PostgreSQL compares ``jsonb`` values, whose numbers
compare as numbers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from sqlalchemy import ColumnElement, String, and_, cast, func, literal
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.sql.elements import ColumnClause

from rollway.store.schemas import MetadataValue as Scalar
from rollway.store.schemas import checked_metadata_filter as checked

__all__ = ["Scalar", "checked", "clauses", "sqlite_terms"]


def _sqlite_types(value: Scalar) -> tuple[str, ...]:
    """The JSON types (SQLite's ``json_type`` names) a stored value must have to equal ``value``."""
    if isinstance(value, bool):
        return ("true",) if value else ("false",)
    if isinstance(value, int | float):
        return ("integer", "real")
    return ("text",)


def sqlite_terms(metadata: Mapping[str, Scalar], prefix: str) -> tuple[str, dict[str, Any]]:
    """SQL text (each term after `` AND ``) and its parameters, for SQLite statements written as text."""
    sql, params = "", dict[str, Any]()
    for i, (key, value) in enumerate(metadata.items()):
        path, kinds = f":{prefix}k{i}", _sqlite_types(value)
        names = ", ".join(f":{prefix}t{i}_{j}" for j in range(len(kinds)))
        sql += f" AND json_type(metadata, {path}) IN ({names})"
        params.update({f"{prefix}t{i}_{j}": kind for j, kind in enumerate(kinds)})
        if not isinstance(value, bool):
            sql += f" AND json_extract(metadata, {path}) = :{prefix}v{i}"
            params[f"{prefix}v{i}"] = value
        params[f"{prefix}k{i}"] = f'$."{key}"'
    return sql, params


def clauses(dialect: str, column: ColumnClause[Any], metadata: Mapping[str, Scalar]) -> list[ColumnElement[bool]]:
    """The filter as SQLAlchemy clauses on ``column`` (a rollout's ``metadata``) for ``dialect``."""
    if dialect == "sqlite":
        out: list[ColumnElement[bool]] = []
        for key, value in metadata.items():
            path = f'$."{key}"'
            typed = func.json_type(column, path).in_(_sqlite_types(value))
            out.append(typed if isinstance(value, bool) else and_(typed, func.json_extract(column, path) == value))
        return out
    return [
        cast(column.op("->")(key), JSONB) == cast(literal(json.dumps(value), String), JSONB)
        for key, value in metadata.items()
    ]
