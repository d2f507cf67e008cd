"""/docs and /redoc render in a real headless browser with every host but the server unreachable: their
Swagger UI and ReDoc assets come from the server itself, not a CDN."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from served import make_final, uvicorn_server

# Slow (a real uvicorn in a subprocess, rendered in headless chromium): not in the fast lane.
pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
BROWSER_TIMEOUT = 120  # seconds for a whole page load: generous, never a speed test


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium. Absent, the test skips on a developer's machine, but fails in CI (``CI`` set),
    where .ci/run installs it."""
    if not os.path.exists(CHROMIUM):
        message = "chromium not found (apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return CHROMIUM


def _dom(browser: str, url: str, profile) -> str:
    """The page's DOM after its scripts ran, with no network but the server's (every name resolves to
    nothing; the server is an IP address)."""
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
             "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", "--virtual-time-budget=8000", "--dump-dom", url]
    # Its own home: chromium would otherwise leave ~/.pki and ~/.cache/chromium behind.
    home = {"HOME": str(profile), "XDG_CONFIG_HOME": str(profile), "XDG_CACHE_HOME": str(profile)}
    done = subprocess.run([browser, *flags], check=False, capture_output=True, text=True,
                          timeout=BROWSER_TIMEOUT, env={**os.environ, **home})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_docs_and_redoc_render_offline(browser, tmp_path):
    make_final(tmp_path / "run", "hyper")
    with uvicorn_server(tmp_path / "run") as (_, base, _lines):
        assert base.startswith("http://127.0.0.1:")
        swagger = _dom(browser, f"{base}/docs", tmp_path / "profile-docs")
        # Swagger UI drew an operation block per route, from /openapi.json.
        assert 'class="opblock' in swagger, swagger[-2000:]
        assert "/v1/predict" in swagger and "Generic class probabilities" in swagger
        redoc = _dom(browser, f"{base}/redoc", tmp_path / "profile-redoc")
        assert "The zero-shot personalized head" in redoc, redoc[-2000:]
