"""Pictures drawn in a second process, which imports matplotlib while the command computes its answer.

matplotlib's import and a picture's rendering take longer than a plan's search on a small machine. When
``megapipe`` runs from its console script, :func:`start` forks a painter process before the command's own
imports; the painter imports the drawing modules at once (on another core) and then draws what the command
hands it (:func:`draw`: a module-level function and its arguments), while the command goes on.
:func:`finish` waits for every picture; a drawing's error reaches the command as one line. Without a painter
(``main()`` called in-process, as tests do, or one core) the pictures are drawn in the calling process by
:func:`finish`, after the command has printed its answer. So a command hands its pictures over as soon as it has
them, either way. The pictures are the same bytes either way: the same functions run on the same records.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from megapipe.errors import MegapipeError

__all__ = ["start", "draw", "finish", "stop"]

_WARM = ("matplotlib.figure", "matplotlib.backends.backend_agg", "megapipe.report.canvas", "megapipe.report.gantt",
         "megapipe.report.plots")
"""What the painter imports before its first picture (then it draws a throwaway one,
:func:`megapipe.report.canvas.warm_up`)."""

_painter = None
"""(process, connection, pictures handed over and not yet finished) of this process's painter, or None."""

_waiting: list = []
"""Without a painter: the drawings :func:`finish` makes here."""


def start() -> None:
    """Fork the painter (nothing when one is running or the machine has one core)."""
    global _painter
    if _painter is not None or (os.cpu_count() or 1) < 2:
        return
    import multiprocessing

    sys.stdout.flush()
    sys.stderr.flush()  # the child must not write the parent's buffered output again
    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe()
    process = context.Process(target=_serve, args=(theirs,), daemon=True)
    process.start()
    theirs.close()
    _painter = [process, ours, 0]


def draw(function: Callable, /, *args, **kwargs) -> None:
    """Draw with ``function(*args, **kwargs)`` in the painter now, or here at :func:`finish` when there is none."""
    if _painter is not None:
        try:
            _painter[1].send((function, args, kwargs))
            _painter[2] += 1
            return
        except (OSError, EOFError):  # the painter is gone: draw here
            stop()
    _waiting.append((function, args, kwargs))


def finish() -> None:
    """Wait until every picture handed over is written (drawing here those no painter took); raise the first
    drawing error."""
    errors = []
    while _waiting:
        function, args, kwargs = _waiting.pop(0)
        try:
            function(*args, **kwargs)
        except Exception as exc:  # as the painter reports it: one line
            errors.append(f"{type(exc).__name__}: {exc}")
    if _painter is None:
        if errors:
            raise MegapipeError(f"drawing a picture failed: {errors[0]}")
        return
    connection = _painter[1]
    while _painter[2]:
        try:
            status, detail = connection.recv()
        except (OSError, EOFError):
            stop()
            raise MegapipeError("the process drawing the pictures stopped before it finished; run again, or set "
                                "output.pictures=false") from None
        _painter[2] -= 1
        if status != "ok":
            errors.append(detail)
    if errors:
        raise MegapipeError(f"drawing a picture failed: {errors[0]}")


def stop() -> None:
    """End the painter (after :func:`finish`, or when the command draws nothing); drawings not made are dropped."""
    global _painter
    _waiting.clear()
    if _painter is None:
        return
    process, connection, _ = _painter
    _painter = None
    try:
        connection.send(None)
    except (OSError, EOFError):
        pass
    connection.close()
    process.join(timeout=5)
    if process.is_alive():
        process.terminate()


def _serve(connection) -> None:
    """The painter: import the drawing modules, then draw each job until told to stop."""
    import importlib
    import queue
    import threading

    jobs: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_receive, args=(connection, jobs), daemon=True).start()
    for name in _WARM:
        importlib.import_module(name)
    try:
        importlib.import_module("megapipe.report.canvas").warm_up()
    except Exception:  # a warm-up is only a head start: the first picture loads what it needs
        pass
    while True:
        job = jobs.get()
        if job is None:
            return
        function, args, kwargs = job
        try:
            function(*args, **kwargs)
            connection.send(("ok", None))
        except Exception as exc:  # reported to the command, which prints it as one line
            connection.send(("error", f"{type(exc).__name__}: {exc}"))


def _receive(connection, jobs) -> None:
    """The painter's reader: take each job off the pipe at once, so the command never waits for a drawing to
    end before it can hand over the next (a Gantt chart's records fill the pipe's buffer many times over)."""
    while True:
        try:
            job = connection.recv()
        except (OSError, EOFError):
            job = None
        jobs.put(job)
        if job is None:
            return
