"""One progress-bar layout for long work: what runs, how far, which item, elapsed time, ETA."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def progress_bar(console: Console | None = None, disable: bool = False) -> Progress:
    """A ``rich`` progress display; tasks carry an ``item`` field (the model or setting now
    running): ``bar.add_task("what", total=n, item="")``. ``disable``: show nothing."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[item]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        disable=disable,
    )
