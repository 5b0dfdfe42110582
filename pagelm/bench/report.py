"""Rendering benchmark results: markdown tables, grouped bar charts (matplotlib, Agg backend),
the machine description, and the generated block of docs/results.md.

Owns presentation only; it never measures.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

BLOCK_BEGIN = "<!-- pagelm bench all: begin -->"
BLOCK_END = "<!-- pagelm bench all: end -->"


def markdown_table(headers: list[str], rows: list[list], align: str | None = None) -> str:
    """A GitHub markdown table; `align` has one letter per column, l or r (default: all l)."""
    align = align or "l" * len(headers)
    if len(align) != len(headers) or any(len(row) != len(headers) for row in rows):
        raise ValueError("every row and the alignment need one entry per header")
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def replace_generated_block(document: str, block: str) -> str:
    """`document` with the text between the begin/end markers replaced by `block` (markers
    kept), or with the marked block appended when the markers are absent."""
    marked = f"{BLOCK_BEGIN}\n{block.strip()}\n{BLOCK_END}\n"
    start, end = document.find(BLOCK_BEGIN), document.find(BLOCK_END)
    if start < 0 and end < 0:
        return document.rstrip("\n") + "\n\n" + marked if document.strip() else marked
    if start < 0 or end < start:
        raise ValueError(f"the document has a broken generated block: {BLOCK_BEGIN!r} must come before {BLOCK_END!r}")
    rest = document[end + len(BLOCK_END):].lstrip("\n")
    return document[:start] + marked + ("\n" + rest if rest else "")


@dataclass
class Panel:
    """One chart panel: bars for each category (x) and series (colour)."""

    title: str
    ylabel: str
    categories: list[str]
    series: dict[str, list[float]]


def bar_chart(path: str, panels: list[Panel], title: str) -> str:
    """Write a PNG of grouped bars, one panel per Panel side by side, each bar labelled with its value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        n = len(panel.series)
        width = 0.8 / max(n, 1)
        for i, (name, values) in enumerate(panel.series.items()):
            xs = [c + (i - (n - 1) / 2) * width for c in range(len(panel.categories))]
            bars = ax.bar(xs, values, width, label=name)
            ax.bar_label(bars, labels=[f"{v:.0f}" if v >= 10 else f"{v:.2g}" for v in values], fontsize=7,
                         padding=1)
        ax.set_xticks(range(len(panel.categories)), panel.categories, rotation=20, ha="right", fontsize=8)
        ax.set_title(panel.title, fontsize=10)
        ax.set_ylabel(panel.ylabel)
        ax.legend(fontsize=8)
        ax.margins(y=0.12)
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def machine_description() -> str:
    import numpy
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    try:
        import numba

        numba_version = f", numba {numba.__version__}"
    except ImportError:
        numba_version = ""
    return (f"{cpu}, {len(os.sched_getaffinity(0))} CPUs available, {memory:.0f} GiB RAM, "
            f"Linux {platform.release()}, Python {platform.python_version()}, numpy {numpy.__version__}"
            f"{numba_version}, torch {torch.__version__} ({torch.get_num_threads()} threads)")
