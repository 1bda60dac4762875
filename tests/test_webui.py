"""The chat page at / (issue 54) in a real headless Chromium: Debian's chromium and
chromium-driver, driven by selenium (skipped where they are not installed; .ci/run installs
them). The page loads with no console error, streams an answer equal to the API's, shows the
tokens/s and acceptance line and marks the accepted drafts, renders `<script>` from the
model as text, keeps the conversation over a reload, asks for the API key once; --no-webui
leaves / a 404. The stream's per-piece `tandem.from_draft` mark is checked over HTTP too.

WEBUI_SCREENSHOT_TO=docs/img/webui.png writes the screenshot there (the real pair's,
with -m slow; the tiny models' otherwise)."""
from __future__ import annotations

import json
import os
import shutil

import pytest

openai = pytest.importorskip("openai")

from serve_helpers import Server, stop_cleanly, tiny_args  # noqa: E402

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1100,820")
XSS = "<script>alert(1)</script>"
CODE = """def is_prime(n):
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True
"""


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    # exact + draft: greedy answers equal the API's, and the draft model's tokens are accepted
    srv = Server([*tiny_args(tiny_models), "--exact", "--strategy", "draft",
                  "--max-tokens", "48"], tmp_path_factory.mktemp("webui-home"))
    yield srv
    stop_cleanly(srv)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    pytest.importorskip("selenium", reason="selenium is a test extra: pip install -e .[test]")
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("no browser: apt-get install chromium chromium-driver (Debian)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tmp_path_factory.mktemp("chromium")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (*FLAGS, f"--user-data-dir={profile / 'data'}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # the driver named: selenium never looks one up; the browser's HOME is the test's
    service = Service(driver, env={**os.environ, "HOME": str(profile)})
    drv = webdriver.Chrome(service=service, options=options)
    yield drv
    drv.quit()


def _wait(browser, condition, timeout: float = 120):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, timeout).until(lambda d: condition())


def _by(browser, css: str):
    from selenium.webdriver.common.by import By

    return browser.find_elements(By.CSS_SELECTOR, css)


def _settings(browser, **fields) -> None:
    details = _by(browser, "details")[0]
    if not details.get_attribute("open"):
        _by(browser, "summary")[0].click()
    for name, value in fields.items():
        box = _by(browser, f"#{name}")[0]
        box.clear()
        box.send_keys(value)


def _send(browser, text: str) -> dict:
    """Send a message from the page; once its answer's final line is there, the answer's
    text, its drafted pieces and the line."""
    n = len(_by(browser, ".msg.assistant"))
    box = _by(browser, "#input")[0]
    if "\n" in text:  # typed, a newline would send (Enter sends, Shift+Enter is a newline)
        browser.execute_script("arguments[0].value = arguments[1]", box, text)
    else:
        box.send_keys(text)
    _by(browser, "#send")[0].click()
    _wait(browser, lambda: len(_by(browser, ".msg.assistant")) > n and
          "accepted" in _by(browser, ".msg.assistant .line")[-1].text and
          not _by(browser, "#send")[0].get_attribute("disabled"))
    answer = _by(browser, ".msg.assistant .text")[-1]
    return {"text": browser.execute_script("return arguments[0].textContent", answer),
            "drafted": [s.get_attribute("textContent")
                        for s in answer.find_elements("css selector", ".d")],
            "line": _by(browser, ".msg.assistant .line")[-1].text}


def _severe(browser) -> list:
    return [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]


def _screenshot(browser, path) -> None:
    browser.save_screenshot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("WEBUI_SCREENSHOT_TO"):
        shutil.copyfile(path, os.environ["WEBUI_SCREENSHOT_TO"])


def test_the_stream_marks_each_accepted_drafts_piece(server):
    """tandem.from_draft on a chunk: its token was a draft the target accepted; as many as
    the answer's accepted drafts (the tiny models: one character a token, each released)."""
    chunks = list(server.client().chat.completions.create(
        model="x", messages=[{"role": "user", "content": "hello there"}], max_tokens=32,
        temperature=0, stream=True))
    marked = sum((c.model_extra.get("tandem") or {}).get("from_draft", 0)
                 for c in chunks if c.choices and c.choices[0].delta.content)
    timings = next(c.model_extra["timings"] for c in chunks if c.model_extra.get("timings"))
    assert timings["draft_n_accepted"] > 0 and marked == timings["draft_n_accepted"]


def test_the_page_chats_and_shows_what_tandem_adds(server, browser, tmp_path):
    status, _, headers = server.raw("GET", "/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert "script-src 'sha256-" in headers["content-security-policy"]
    browser.get(f"http://127.0.0.1:{server.port}/")
    _wait(browser, lambda: "slots" in _by(browser, "#server")[0].text)
    assert _by(browser, "#model")[0].text == "target"
    assert "tokens served" in _by(browser, "#server")[0].text  # /metrics read
    _settings(browser, temperature="0", max_tokens="24")
    got = _send(browser, "hello there")
    api = server.client().chat.completions.create(
        model="x", messages=[{"role": "user", "content": "hello there"}], max_tokens=24,
        temperature=0)
    assert got["text"] == api.choices[0].message.content and got["text"]
    accepted = api.model_extra["timings"]["draft_n_accepted"]
    assert "tok/s" in got["line"] and f"drafts {accepted}/" in got["line"]
    assert len("".join(got["drafted"])) == accepted > 0  # marked as the terminal marks them

    # markup from the model is text: a grammar makes the model write a script tag
    _settings(browser, max_tokens="40",
              extra=json.dumps({"grammar": f"root ::= {json.dumps(XSS)}"}))
    got = _send(browser, "show me a tag")
    assert got["text"] == XSS and 0 < len("".join(got["drafted"])) < len(XSS)  # forced: drafts
    assert _by(browser, "#chat script") == [] and _by(browser, "#chat span:not(.d)") == []
    assert browser.execute_script("return document.scripts.length") == 1  # the page's own
    _screenshot(browser, tmp_path / "webui.png")

    browser.refresh()  # the conversation is kept in the browser
    _wait(browser, lambda: len(_by(browser, ".msg")) == 4)
    texts = [browser.execute_script("return arguments[0].textContent", t)
             for t in _by(browser, ".msg .text")]
    assert texts[0] == "hello there" and texts[3] == XSS
    assert _severe(browser) == []


def test_the_page_asks_for_the_api_key_once(tiny_models, tmp_path, browser):
    srv = Server([*tiny_args(tiny_models), "--api-key", "s3cret", "--max-tokens", "8"],
                 tmp_path / "home")
    try:
        browser.get(f"http://127.0.0.1:{srv.port}/")
        browser.execute_script("localStorage.clear(); sessionStorage.clear()")
        browser.refresh()
        _wait(browser, lambda: _by(browser, "#keybox")[0].is_displayed())
        _by(browser, "#key")[0].send_keys("s3cret")
        _by(browser, "#keyok")[0].click()
        _wait(browser, lambda: _by(browser, "#model")[0].text == "target")
        got = _send(browser, "hi")
        assert got["text"] and not _by(browser, "#keybox")[0].is_displayed()
        assert browser.execute_script("return sessionStorage.getItem('tandem.key')") == "s3cret"
        # the 401s before the key (the model's name, the figures) are the only errors
        assert all("401" in e["message"] for e in _severe(browser))
    finally:
        browser.get("about:blank")  # the page polls: not a server that is gone
        stop_cleanly(srv)


def test_the_page_ships_in_the_package():
    """One static file, package data (a wheel carries it), nothing fetched from elsewhere."""
    import tomllib
    from fnmatch import fnmatch
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["tandem"]
    assert any(fnmatch("serve/webui/index.html", g) for g in globs), globs
    html = (root / "cli" / "tandem" / "serve" / "webui" / "index.html").read_text()
    assert "http://" not in html and "https://" not in html and "innerHTML" not in html


def test_no_webui_leaves_the_root_a_404(tiny_models, tmp_path):
    srv = Server([*tiny_args(tiny_models), "--no-webui"], tmp_path)
    try:
        status, body, _ = srv.raw("GET", "/")
        assert status == 404 and body["error"]["message"] == "no route /"
        assert srv.raw("GET", "/health")[0] == 200
    finally:
        stop_cleanly(srv)


@pytest.mark.slow
def test_real_pair_page(real_pair, browser, tmp_path):
    """The real pair answering a coding question in the page: the accepted drafts marked,
    the line with tokens/s and acceptance (docs/img/webui.png is this page)."""
    target, draft = real_pair
    # ngram: the page shows drafts whatever the machine's load (auto weighs a loaded CPU's
    # verify rows and may draft nothing there; its decisions are tested on scripted costs)
    srv = Server(["-m", str(target), "-md", str(draft), "--max-tokens", "200",
                  "--strategy", "ngram"], tmp_path)
    browser.get_log("browser")  # what earlier pages logged
    try:
        browser.get(f"http://127.0.0.1:{srv.port}/")
        browser.execute_script("localStorage.clear()")
        browser.refresh()
        _wait(browser, lambda: "slots" in _by(browser, "#server")[0].text)
        _settings(browser, temperature="0", max_tokens="200", extra="")
        _by(browser, "summary")[0].click()  # settings closed for the picture
        # an edit that copies most of the code it is given: drafted from the prompt
        got = _send(browser, "Add type hints and a docstring to this function:\n\n" + CODE)
        assert "def is_prime" in got["text"] and got["drafted"] and "tok/s" in got["line"]
        _wait(browser, lambda: " 0 tokens served" not in _by(browser, "#server")[0].text)
        _screenshot(browser, tmp_path / "webui.png")
        assert _severe(browser) == []
    finally:
        stop_cleanly(srv)
