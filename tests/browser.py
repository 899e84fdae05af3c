"""Shared by the browser tests of the self-contained pages (dashboard, audit): open a page in
headless Chromium (Playwright driving the system browser, no download), read its embedded
data, and find a heatmap cell on screen from plotly's own axis mapping."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")


def page_data(page: str) -> dict:
    """The JSON a page embeds in its ``phasemech-data`` script block."""
    return json.loads(re.search(r'id="phasemech-data">(.*?)</script>', page, re.S).group(1))


@contextlib.contextmanager
def browser(page_path: Path, ready: str, width: int = 1300):
    """``(page, errors)``: ``page_path`` opened and plotted (``ready``: a CSS selector that
    exists once it is); ``errors`` collects uncaught page errors. Skips without a browser."""
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright not installed")
    if not CHROMIUM.exists():
        pytest.skip("no /usr/bin/chromium (make test installs it with apt-get where root)")
    errors: list[str] = []
    with playwright.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        page = chromium.new_page(viewport={"width": width, "height": 1000})
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(page_path.as_uri())
        page.wait_for_selector(ready)
        yield page, errors
        chromium.close()


def cell_xy(page, plot: str, row: int, col: int) -> tuple[float, float]:
    """Viewport coordinates of heatmap cell (row, col) of the plot with id ``plot``."""
    return page.evaluate(
        """([plot, row, col]) => {
            const gd = document.getElementById(plot);
            gd.scrollIntoView();
            const L = gd._fullLayout, r = gd.getBoundingClientRect();
            return [r.left + L.xaxis._offset + L.xaxis.l2p(col),
                    r.top + L.yaxis._offset + L.yaxis.l2p(row)];
        }""",
        [plot, row, col],
    )
