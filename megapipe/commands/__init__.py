"""One module per CLI subcommand, each exposing ``run(cfg) -> None``.

``run`` prints with rich (or one JSON object for ``output.format=json``), writes
its files under the Hydra output directory, and raises :class:`~megapipe.errors.MegapipeError`
for bad input; ``megapipe.cli`` turns that into one line on stderr and exit code 2.
"""

COMMANDS = ("plan", "partition", "simulate", "report", "profile", "calibrate", "replan", "validate", "pack")

DRAWING = ("plan", "simulate", "report", "pack")
"""The commands that draw pictures (:mod:`megapipe.commands.painter` starts before their imports)."""
