"""A small document model written out as Markdown and as one self-contained HTML page.

The report is built once as blocks; Markdown links the PNGs beside it and
the HTML page embeds them as data URIs, so it can be mailed or archived as a
single file.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Heading:
    level: int
    text: str


@dataclass(frozen=True)
class Paragraph:
    text: str


@dataclass(frozen=True)
class Table:
    header: list[str]
    rows: list[list[str]]


@dataclass(frozen=True)
class Image:
    title: str
    path: Path


@dataclass(frozen=True)
class Code:
    text: str


Block = Heading | Paragraph | Table | Image | Code


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(blocks: list[Block], directory: Path) -> str:
    out: list[str] = []
    for block in blocks:
        if isinstance(block, Heading):
            out.append("#" * block.level + " " + block.text)
        elif isinstance(block, Paragraph):
            out.append(block.text)
        elif isinstance(block, Table):
            out.append("| " + " | ".join(_md_cell(h) for h in block.header) + " |")
            out.append("|" + "---|" * len(block.header))
            out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in block.rows]
        elif isinstance(block, Image):
            out.append(f"![{block.title}]({block.path.relative_to(directory).as_posix()})")
        else:
            out.append("```\n" + block.text + "\n```")
        out.append("")
    return "\n".join(out)


STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; }
th { background: #f3f3f3; }
img { max-width: 100%; border: 1px solid #eee; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
code { background: #f3f3f3; padding: 0 0.2em; }
"""


def _inline(text: str) -> str:
    """Markdown's `code` and **bold** in a line of text, escaped."""
    parts = html.escape(text).split("`")
    out = "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))
    bold = out.split("**")
    return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(bold))


def to_html(blocks: list[Block], title: str) -> str:
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
           f"<style>{STYLE}</style></head><body>"]
    for block in blocks:
        if isinstance(block, Heading):
            out.append(f"<h{block.level}>{_inline(block.text)}</h{block.level}>")
        elif isinstance(block, Paragraph):
            out.append(f"<p>{_inline(block.text)}</p>")
        elif isinstance(block, Table):
            head = "".join(f"<th>{_inline(h)}</th>" for h in block.header)
            rows = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in row) + "</tr>" for row in block.rows)
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif isinstance(block, Image):
            data = base64.b64encode(block.path.read_bytes()).decode()
            out.append(f"<figure><img alt='{html.escape(block.title)}' src='data:image/png;base64,{data}'>"
                       f"<figcaption>{html.escape(block.title)}</figcaption></figure>")
        else:
            out.append(f"<pre>{html.escape(block.text)}</pre>")
    out.append("</body></html>")
    return "\n".join(out)
