"""Headless Chromium for the tests that check pages in a real browser (Debian's `chromium`
package): load a page, dump its DOM, take a screenshot, and say what failed to load."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
NO_BROWSER = "no chromium here (Debian: apt-get install chromium)"


@dataclass(frozen=True)
class Rendered:
    """A page as the browser saw it."""

    dom: str  # the DOM after scripts ran (--dump-dom)
    screenshot: Path
    log: str  # the browser's stderr, both runs: failed loads show as net::ERR_...


def render(page: Path, screenshot: Path, *, size: str = "1000,1200") -> Rendered:
    """Load ``page`` in headless Chromium twice: once for its DOM, once for a screenshot.

    Both runs must exit 0; the caller checks the text and ``log`` (``net::ERR`` is a resource
    that did not load).
    """
    assert BROWSER is not None, NO_BROWSER
    common = [
        BROWSER,
        "--headless",
        "--no-sandbox",  # tests run as root in containers
        "--disable-gpu",
        "--enable-logging=stderr",
        "--v=0",
    ]
    dom = subprocess.run(
        [*common, "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    shot = subprocess.run(
        [*common, f"--screenshot={screenshot}", f"--window-size={size}", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert shot.returncode == 0, shot.stderr[-2000:]
    return Rendered(dom.stdout, screenshot, dom.stderr + shot.stderr)
