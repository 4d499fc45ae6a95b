"""Rollouts picked by their task's mode, group and metadata: the filters of a claim (``queue.claim``) and of an
export (``exports``).

A metadata filter ``{"step": 3, "split": "a"}`` holds for a rollout whose task metadata has each key at that
value. Values are JSON scalars (a string, a number, true or false) compared as the engine reads them from the
stored JSON: SQLite's ``json_extract`` gives the value itself (so ``true`` and ``1`` are one value there);
PostgreSQL's ``->>`` gives its JSON text, so a number matches as it was written (``3`` is not ``3.0``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from sqlalchemy import ColumnElement, func
from sqlalchemy.sql.elements import ColumnClause

from rollway.store.schemas import MetadataValue as Scalar
from rollway.store.schemas import checked_metadata_filter as checked

__all__ = ["Scalar", "checked", "clauses", "sqlite_terms"]


def sqlite_terms(metadata: Mapping[str, Scalar], prefix: str) -> tuple[str, dict[str, Any]]:
    """SQL text (each term after `` AND ``) and its parameters, for SQLite statements written as text."""
    sql, params = "", dict[str, Any]()
    for i, (key, value) in enumerate(metadata.items()):
        sql += f" AND json_extract(metadata, :{prefix}k{i}) = :{prefix}v{i}"
        params[f"{prefix}k{i}"] = f'$."{key}"'
        params[f"{prefix}v{i}"] = int(value) if isinstance(value, bool) else value
    return sql, params


def clauses(dialect: str, column: ColumnClause[Any], metadata: Mapping[str, Scalar]) -> list[ColumnElement[bool]]:
    """The filter as SQLAlchemy clauses on ``column`` (a rollout's ``metadata``) for ``dialect``."""
    if dialect == "sqlite":
        return [
            func.json_extract(column, f'$."{key}"') == (int(value) if isinstance(value, bool) else value)
            for key, value in metadata.items()
        ]
    return [
        column.op("->>")(key) == (value if isinstance(value, str) else json.dumps(value))
        for key, value in metadata.items()
    ]
