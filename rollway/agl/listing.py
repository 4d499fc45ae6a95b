"""Agent-lightning's query semantics over plain lists: field filters joined by ``and``/``or``, sorting by
one field, ``limit`` (-1 = all) and ``offset``, and its page shape ``{items, limit, offset, total}``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

Item = dict[str, Any]
Predicate = Callable[[Item], bool]


#: The largest ``limit`` and ``offset`` a query may give: a signed 64-bit integer, what the databases' ``LIMIT``
#: and ``OFFSET`` and the answer's JSON encoder (orjson) carry. Any larger value cannot be served (a 400, as the
#: admin API answers), and none is needed: a limit this large already means "all".
MAX_PAGING = 2**63 - 1


class QueryError(ValueError):
    """A query Agent-lightning's server would refuse (400)."""


def matches(item: Item, predicates: Sequence[Predicate], logic: Literal["and", "or"]) -> bool:
    if not predicates:
        return True
    if logic == "or":
        return any(p(item) for p in predicates)
    return all(p(item) for p in predicates)


def exact(field: str, value: Any) -> Predicate:
    return lambda item: item.get(field) == value


def within(field: str, values: Sequence[Any]) -> Predicate:
    wanted = set(values)
    return lambda item: item.get(field) in wanted


def contains(field: str, text: str) -> Predicate:
    return lambda item: isinstance(item.get(field), str) and text in item[field]


def _sort_key(field: str) -> Callable[[Item], tuple[int, Any]]:
    def key(item: Item) -> tuple[int, Any]:
        value = item.get(field)
        if value is None:
            return (1, 0)
        if isinstance(value, dict | list):
            return (0, repr(value))
        return (0, value)

    return key


def check_paging(allowed_sort: Sequence[str], sort_by: str | None, limit: int, offset: int) -> None:
    """Refuse what Agent-lightning's server refuses, with its messages."""
    if sort_by is not None and sort_by not in allowed_sort:
        raise QueryError(f"Invalid sort_by: {sort_by}, allowed fields are: {', '.join(allowed_sort)}")
    if limit == 0 or limit < -1:
        raise QueryError("Limit must be greater than 0 or -1 for no limit")
    if offset < 0:
        raise QueryError("Offset must be greater than or equal to 0")
    if limit > MAX_PAGING or offset > MAX_PAGING:
        raise QueryError(f"Limit and offset must be at most {MAX_PAGING}")


def page(
    items: list[Item],
    *,
    allowed_sort: Sequence[str],
    sort_by: str | None,
    sort_order: Literal["asc", "desc"],
    limit: int,
    offset: int,
) -> dict[str, Any]:
    check_paging(allowed_sort, sort_by, limit, offset)
    if sort_by is not None:
        try:
            items = sorted(items, key=_sort_key(sort_by), reverse=sort_order == "desc")
        except TypeError:
            items = sorted(items, key=lambda i: repr(i.get(sort_by)), reverse=sort_order == "desc")
    total = len(items)
    window = items[offset:] if limit == -1 else items[offset : offset + limit]
    return {"items": window, "limit": limit, "offset": offset, "total": total}
