"""Assemble the self-contained HTML page: inline CSS, images as base64 data URIs, no external assets."""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from datetime import UTC, datetime

from hybridpar.humanize import fmt, human_bytes, human_time

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1100px;
color:#222;line-height:1.4;padding:0 1em}
h1{font-size:1.6em;margin-bottom:.2em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}
th,td{border:1px solid #ddd;padding:.25em .6em;text-align:right}th{background:#f4f4f4}
td.l,th.l{text-align:left}tr.override td{background:#fff8e1}
.note{color:#8a6d3b;background:#fcf8e3;border:1px solid #faebcc;padding:.4em .8em;margin:.4em 0}
img{max-width:100%;display:block;margin:.6em 0}.muted{color:#777;font-size:.85em}
dl{display:grid;grid-template-columns:max-content auto;gap:.2em 1em}dt{font-weight:600}dd{margin:0}
"""


@dataclass
class Section:
    """One titled part of the page; its body is already-escaped HTML."""

    id: str
    title: str
    parts: list[str] = field(default_factory=list)

    def text(self, s: str) -> Section:
        self.parts.append(f"<p>{html.escape(s)}</p>")
        return self

    def note(self, s: str) -> Section:
        self.parts.append(f'<p class="note">{html.escape(s)}</p>')
        return self

    def image(self, png: bytes, alt: str) -> Section:
        b64 = base64.b64encode(png).decode("ascii")
        self.parts.append(f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{b64}">')
        return self

    def facts(self, items: list[tuple[str, object]]) -> Section:
        rows = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(cell(v))}</dd>" for k, v in items)
        self.parts.append(f"<dl>{rows}</dl>")
        return self

    def table(self, columns: list[str], rows: list[list[object]], left: int = 1,
              row_classes: list[str] | None = None) -> Section:
        """`left`: how many leading columns are text (left-aligned)."""
        head = "".join(f'<th{" class=l" if i < left else ""}>{html.escape(c)}</th>'
                       for i, c in enumerate(columns))
        body = []
        for r, row in enumerate(rows):
            cls = f' class="{row_classes[r]}"' if row_classes and row_classes[r] else ""
            tds = "".join(f'<td{" class=l" if i < left else ""}>{html.escape(cell(v))}</td>'
                          for i, v in enumerate(row))
            body.append(f"<tr{cls}>{tds}</tr>")
        self.parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>")
        return self


def cell(v: object) -> str:
    if v is None:
        return "-"
    return fmt(v)


def seconds(v: float) -> str:
    return human_time(v)


def nbytes(v: float) -> str:
    return human_bytes(v)


def render(title: str, subtitle: str, sections: list[Section]) -> str:
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    toc = " · ".join(f'<a href="#{s.id}">{html.escape(s.title)}</a>' for s in sections)
    body = "\n".join(f'<section id="{s.id}"><h2>{html.escape(s.title)}</h2>{"".join(s.parts)}</section>'
                     for s in sections)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
            f"<h1>{html.escape(title)}</h1><p class=muted>{html.escape(subtitle)} · generated {stamp} "
            f"by hybridpar</p><nav>{toc}</nav>\n{body}\n</body></html>\n")
