"""How megapipe's pictures are made: matplotlib on first use, sizes in inches at a fixed DPI, same bytes.

matplotlib takes about a second to import, so it is imported here, inside functions, and only when a picture
is drawn: importing megapipe (or starting the CLI) never loads it. Every picture is built and saved under
matplotlib's default style (a user's matplotlibrc changes neither the look nor the bytes) and saved at
:data:`DPI` with the PNG text metadata dropped (matplotlib writes its version there; it writes no date), then
written atomically through :mod:`megapipe.files`. Layouts are placed in inches rather than by
``tight_layout``: the margins stay the same whatever the rank count, and no extra draw pass is paid for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from megapipe.files import atomic_write_bytes

__all__ = ["DPI", "pinned_style", "new_figure", "place_axes", "fitted", "text_width_in", "title_lines",
           "put_title", "legend_width_in", "legend_row", "save_png", "png_bytes", "warm_up"]

DPI = 100
"""Pixels per inch of every picture: a 12-inch-wide figure is 1,200 pixels wide."""

_META = {"Software": None}
"""The only text chunk matplotlib's Agg writer adds; None drops it (it names the matplotlib version)."""


@contextlib.contextmanager
def pinned_style() -> Iterator[None]:
    """matplotlib's default style for what is built or drawn inside (rc settings are read at both times)."""
    import matplotlib.style

    with matplotlib.style.context("default"):
        yield


def new_figure(width_in: float, height_in: float):
    """An empty figure of that size at :data:`DPI` on its own Agg canvas (no pyplot: no global figure list to
    close), so text can be measured before anything is placed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width_in, height_in), dpi=DPI)
    FigureCanvasAgg(figure)
    return figure


def place_axes(figure, *, left_in: float, bottom_in: float, width_in: float, height_in: float):
    """Axes at fixed inches from the figure's lower left corner."""
    figure_width, figure_height = figure.get_size_inches()
    return figure.add_axes((left_in / figure_width, bottom_in / figure_height, width_in / figure_width,
                            height_in / figure_height))


def fitted(figure, text: str, *, width_in: float, fontsize: float, max_lines: int = 1,
           breaks: str = " |") -> str:
    """``text`` in at most ``max_lines`` lines no wider than ``width_in`` at ``fontsize``, broken after one of
    ``breaks`` where it can be, the last line cut with an ellipsis when the rest does not fit."""
    def fits(line: str) -> bool:
        return text_width_in(figure, line, fontsize=fontsize) <= width_in

    lines, rest = [], text
    while rest and len(lines) < max_lines:
        last = len(lines) == max_lines - 1
        cut = _longest_fitting(rest, fits, suffix="…" if last else "")
        if cut == len(rest):
            lines.append(rest)
            break
        if not last:
            at = max(rest.rfind(mark, 0, cut) for mark in breaks)
            cut = at + 1 if at > 0 else cut
            lines.append(rest[:cut].rstrip())
            rest = rest[cut:].lstrip()
        else:
            lines.append(rest[:cut].rstrip() + "…")
            break
    return "\n".join(lines)


def text_width_in(figure, text: str, *, fontsize: float) -> float:
    """How wide ``text`` is drawn at ``fontsize`` on the figure, in inches."""
    from matplotlib.font_manager import FontProperties

    renderer = figure.canvas.get_renderer()
    return renderer.get_text_width_height_descent(text, FontProperties(size=fontsize), ismath=False)[0] / figure.dpi


def _longest_fitting(text: str, fits, *, suffix: str) -> int:
    """The longest prefix length of ``text`` that fits with ``suffix`` after it (a bisection: measuring a line
    costs milliseconds)."""
    if fits(text):
        return len(text)
    low, high = 1, len(text) - 1
    while low < high:
        middle = (low + high + 1) // 2
        if fits(text[:middle] + suffix):
            low = middle
        else:
            high = middle - 1
    return low


def title_lines(figure, text: str, *, width_in: float, fontsize: float = 11,
                max_lines: int = 2) -> tuple[str, float]:
    """``text`` fitted to ``width_in`` (:func:`fitted`), and the height in inches it takes as the figure's title
    (its lines and the margins), which the layout keeps free of axes."""
    lines = fitted(figure, text, width_in=width_in, fontsize=fontsize, max_lines=max_lines)
    return lines, 0.2 + 0.2 * (lines.count("\n") + 1) * fontsize / 11


def put_title(figure, lines: str, *, fontsize: float = 11) -> None:
    """The title from :func:`title_lines`, centred at the top; call it once the figure has its final size."""
    height_in = figure.get_size_inches()[1]
    figure.text(0.5, 1 - 0.12 / height_in, lines, ha="center", va="top", fontsize=fontsize, linespacing=1.1)


def legend_width_in(figure, labels, *, fontsize: float = 9) -> float:
    """How wide :func:`legend_row` draws ``labels`` in one row: each label with its handle and the gaps."""
    return sum(text_width_in(figure, label, fontsize=fontsize) + fontsize * 0.07 for label in labels) + 0.2


def legend_row(figure, handles, labels, *, top_in: float, fontsize: float = 9, **options):
    """A frameless legend in one row, centred, its top ``top_in`` inches above the figure's bottom edge: under an
    axis, outside the data, so it never covers a bar."""
    height_in = figure.get_size_inches()[1]
    options.setdefault("ncol", max(1, len(handles)))
    return figure.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, top_in / height_in),
                         fontsize=fontsize, frameon=False, borderaxespad=0.2, **options)


def save_png(figure, path: str) -> str:
    """The figure as PNG at :data:`DPI` without text metadata (same inputs, same bytes), written atomically."""
    atomic_write_bytes(path, png_bytes(figure))
    return path


def png_bytes(figure) -> bytes:
    """The figure as PNG at :data:`DPI` without text metadata."""
    import io

    buffer = io.BytesIO()
    with pinned_style():
        figure.savefig(buffer, format="png", dpi=DPI, facecolor="white", metadata=_META)
    return buffer.getvalue()


def warm_up() -> None:
    """Draw a small throwaway picture (axes, ticks, a title, patches, a legend, text at several sizes) into memory,
    so matplotlib's font, layout and PNG paths are loaded before the first real picture: a process that draws while
    a command computes (:mod:`megapipe.commands.painter`) pays that load then, not while the command waits. It
    changes no picture's bytes."""
    from matplotlib.patches import Rectangle

    with pinned_style():
        figure = new_figure(2.0, 1.5)
        axes = place_axes(figure, left_in=0.5, bottom_in=0.5, width_in=1.2, height_in=0.8)
        axes.add_patch(Rectangle((0.1, 0.1), 0.5, 0.5, color="tab:blue"))
        axes.set_title("warm", fontsize=10, loc="left")
        axes.set_xlabel("x", fontsize=9)
        axes.text(0.5, 0.5, "warm", fontsize=7)
        legend_row(figure, [Rectangle((0, 0), 1, 1, color="tab:orange")], ["warm"], top_in=0.3, fontsize=8)
    png_bytes(figure)
