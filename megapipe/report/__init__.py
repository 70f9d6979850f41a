"""Reports of results: Gantt charts, traces, tables and plots.

Each module imports its heavy dependencies (matplotlib) lazily, so importing
this package costs nothing.
"""
