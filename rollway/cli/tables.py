"""Tables of the ``rollway`` command that never split a word across lines, whatever the terminal's width.

Each column says what it holds, and so what a narrow terminal may do to it:

- ``name`` (an alias, a URL, a model, a kind, a status, a number): always shown whole on one line;
- ``id`` (a rollout, group or backend id): shortened with an ellipsis, to no fewer than ``ID_MIN`` cells;
- ``text`` (a time, JSON, a header of several words): wrapped between its words, never within one.

Rich left alone narrows whichever columns are widest and folds their words (``backen/d``, ``mock-mo/del``), so
the widths are chosen here: text wraps first, then ids shrink; a table that still does not fit is shown as one
block of ``header  value`` lines per row instead, where every name fits whole (only one wider than the whole
terminal is cut, with an ellipsis).
"""

from __future__ import annotations

from typing import Literal

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

Kind = Literal["name", "id", "text"]
ID_MIN = 10  # cells an id keeps when shortened ("ro-7d26ca…"): enough to tell rows apart
GAP = 2  # cells between two columns


class FitTable:
    """A table of ``(header, kind)`` columns; rows of Rich markup strings (a cell may hold several lines)."""

    def __init__(self, *columns: tuple[str, Kind]) -> None:
        self.columns = list(columns)
        self.rows: list[tuple[list[str], bool]] = []  # (cells, ends a section)

    def add_row(self, *cells: str, end_section: bool = False) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{len(cells)} cells for {len(self.columns)} columns")
        self.rows.append((list(cells), end_section))

    def widths(self, width: int) -> list[int] | None:
        """Each column's width for a terminal ``width`` cells wide, or None if the table cannot fit."""
        texts = [[Text(header)] for header, _ in self.columns]
        for cells, _ in self.rows:
            for i, cell in enumerate(cells):
                texts[i].append(Text.from_markup(cell, emoji=False))
        natural = [max(_longest_line(text) for text in column) for column in texts]
        smallest = []
        for (header, kind), column, wide in zip(self.columns, texts, natural, strict=True):
            if kind == "text":
                smallest.append(max(_longest_word(text) for text in column))
            elif kind == "id":
                smallest.append(min(wide, max(ID_MIN, len(header))))
            else:
                smallest.append(wide)
        room = width - GAP * (len(self.columns) - 1)
        if sum(smallest) > room:
            return None
        widths, excess = list(natural), sum(natural) - room
        for shrinking in ("text", "id"):  # text wraps before any id is shortened; the widest gives way first
            while excess > 0:
                able = [i for i, (_, kind) in enumerate(self.columns) if kind == shrinking and widths[i] > smallest[i]]
                if not able:
                    break
                widths[max(able, key=lambda i: widths[i])] -= 1
                excess -= 1
        return widths

    def table(self, widths: list[int]) -> Table:
        """The rows as a compact table (two spaces between columns, a rule under the header)."""
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
        for (header, kind), width in zip(self.columns, widths, strict=True):
            table.add_column(
                header,
                max_width=width,
                no_wrap=kind != "text",
                overflow="fold" if kind == "text" else "ellipsis",  # text has no word wider than its column
            )
        for cells, end_section in self.rows:
            table.add_row(*cells, end_section=end_section)
        return table

    def records(self, console: Console) -> RenderableType:
        """Each row as a block of ``header  value`` lines (its empty cells left out), blocks apart by a line. A
        value too wide to stand beside its header goes whole on the line under it; text wraps between words."""
        width = console.width
        key = max(len(header) for header, _ in self.columns) + GAP
        lines: list[Text] = []
        for cells, _ in self.rows:
            if lines:
                lines.append(Text())
            for (header, kind), cell in zip(self.columns, cells, strict=True):
                if not cell:
                    continue
                value = Text.from_markup(cell, emoji=False)
                if kind == "text":
                    parts = list(value.wrap(console, max(width - key, 1), overflow="ellipsis"))
                else:
                    parts = list(value.split(allow_blank=True))
                if max(part.cell_len for part in parts) > width - key:
                    lines.append(Text(header, style="dim"))  # and the value on lines of its own
                    lines += parts
                    continue
                for i, part in enumerate(parts):
                    label = Text(header if i == 0 else "", style="dim")
                    label.pad_right(key - label.cell_len)
                    lines.append(label.append_text(part))
        for line in lines:  # only a value wider than the whole terminal is cut, with an ellipsis: never folded
            line.no_wrap, line.overflow = True, "ellipsis"
        return Group(*lines)


def render(console: Console, *layouts: FitTable) -> RenderableType:
    """The first layout that fits the console as a table, else the first one's rows as records."""
    for layout in layouts:
        widths = layout.widths(console.width)
        if widths is not None:
            return layout.table(widths)
    return layouts[0].records(console)


def _longest_line(text: Text) -> int:
    return max((line.cell_len for line in text.split(allow_blank=True)), default=0)


def _longest_word(text: Text) -> int:
    return max((Text(word).cell_len for word in text.plain.split()), default=0)
