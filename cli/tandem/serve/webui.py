"""The chat page at / : one static file shipped in the package (serve/webui/index.html; no
build step, nothing fetched from elsewhere, so it works offline) that streams answers from
/v1/chat/completions, keeps the conversation in the browser and shows what tandem adds:
each answer's tokens/s and acceptance, the drafted tokens the target accepted marked as the
terminal chat marks them, the slots and /metrics at a glance. `--no-webui`: / is a 404.

The page sets model text with textContent only, and its Content-Security-Policy lets no
script run but its own (by hash) and lets it reach this server only."""
from __future__ import annotations

import base64
import functools
import hashlib
import re
from importlib import resources

from starlette.exceptions import HTTPException
from starlette.responses import HTMLResponse

from tandem.serve.server_state import ApiCall, ServerState


@functools.cache
def page_and_headers() -> tuple[bytes, dict]:
    html = resources.files("tandem.serve").joinpath("webui/index.html").read_bytes()
    scripts = re.findall(rb"<script>(.*?)</script>", html, re.S)
    hashes = " ".join("'sha256-" + base64.b64encode(hashlib.sha256(s).digest()).decode() + "'"
                      for s in scripts)
    policy = (f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; "
              "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
              "frame-ancestors 'none'")
    return html, {"Content-Security-Policy": policy, "X-Content-Type-Options": "nosniff",
                  "Cache-Control": "no-cache", "Referrer-Policy": "no-referrer"}


async def page(state: ServerState, call: ApiCall):
    if not state.config.webui:
        raise HTTPException(404)
    html, headers = page_and_headers()
    return HTMLResponse(html, headers=headers)
