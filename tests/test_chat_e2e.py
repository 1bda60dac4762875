"""`tandem chat` end to end: in tmux (a real terminal: live panel, Ctrl-C), and through a pipe.

The tmux test needs the `tmux` binary (Debian/Ubuntu: `apt-get install -y tmux`); without it
the test is skipped. Set TANDEM_E2E_CAPTURE=DIR to keep the captured screens (docs/chat.md
shows one).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

TMUX = shutil.which("tmux")
BASH = shutil.which("bash")
WIDTH, HEIGHT = 100, 40
_SGR = re.compile(r"\x1b\[([0-9;]*)m")


class Pane:
    """A tmux session on its own socket running one command."""

    def __init__(self, socket: Path, command: list[str], env: dict[str, str]):
        self.base = [TMUX, "-S", str(socket), "-f", os.devnull]
        env_args = [f"{k}={v}" for k, v in env.items()]
        # bash reports the exit status on screen (tmux 3.3's pane_dead_status is sometimes never
        # set); unlike dash, bash survives a Ctrl-C that its child handled
        wrapper = [BASH, "-c", '"$@"; echo "[exit status $?]"; sleep 60', "bash"]
        self.tmux("new-session", "-d", "-s", "t", "-x", str(WIDTH), "-y", str(HEIGHT),
                  "env", *env_args, *wrapper, *command)

    def tmux(self, *args: str) -> str:
        res = subprocess.run([*self.base, *args], capture_output=True, text=True, timeout=20)
        if res.returncode != 0:
            raise RuntimeError(f"tmux {args[0]} failed: {res.stderr.strip()}")
        return res.stdout

    def send(self, text: str, enter: bool = True) -> None:
        self.tmux("send-keys", "-t", "t", "-l", text)
        if enter:
            self.tmux("send-keys", "-t", "t", "Enter")

    def key(self, key: str) -> None:
        self.tmux("send-keys", "-t", "t", key)

    def screen(self, escapes: bool = False) -> str:
        return self.tmux("capture-pane", "-p", "-t", "t", *(["-e"] if escapes else []))

    def history(self) -> str:
        return self.tmux("capture-pane", "-p", "-J", "-t", "t", "-S", "-")

    def exited(self) -> bool:
        return "[exit status" in self.history()

    def wait(self, check, what: str, timeout: float = 30.0, full: bool = True) -> str:
        """Poll the screen (or the whole history) until check(text) holds."""
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            text = self.history() if full else self.screen()
            if check(text):
                return text
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; the screen was:\n{text}")

    def kill(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True, timeout=20)


def prompts(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.startswith(">>>"))


def summaries(text: str) -> int:
    return len(re.findall(r"tok/s · \d+ tokens", text))


def colour_codes(data: str) -> list[int]:
    """Foreground/background colour parameters of SGR sequences (39/49, "default colour", which
    tmux writes on its own, do not count)."""
    return [int(p) for params in _SGR.findall(data) for p in params.split(";")
            if p.isdigit() and (30 <= int(p) <= 48 or 90 <= int(p) <= 107) and int(p) != 39]


@pytest.mark.skipif(TMUX is None or BASH is None,
                    reason="tmux (and bash) needed: apt-get install -y tmux")
def test_chat_in_tmux(tiny_models, tmp_path):
    cmd = [sys.executable, "-m", "tandem", "chat", "-m", str(tiny_models["target"]),
           "-md", str(tiny_models["draft"]), "-t", "1", "-n", "40", "-c", "8192"]
    env = {"NO_COLOR": "1", "TERM": "xterm-256color", "TANDEM_HOME": str(tmp_path / "home"),
           "PYTHONFAULTHANDLER": "1",
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    pane = Pane(tmp_path / "tmux.sock", cmd, env)
    keep = os.environ.get("TANDEM_E2E_CAPTURE")
    try:
        # start: models load, plain decoding is measured, the banner and a prompt appear
        text = pane.wait(lambda s: "tandem chat · target.gguf + draft.gguf" in s and prompts(s) == 1,
                         "the first prompt")
        assert "plain decoding measured here" in text

        # two turns, each answered with a summary line; the answers stay on screen
        pane.send("hello there")
        text = pane.wait(lambda s: summaries(s) == 1 and prompts(s) == 2, "the first answer")
        pane.send("and what comes next?")
        text = pane.wait(lambda s: summaries(s) == 2 and prompts(s) == 3, "the second answer")
        # the summary wraps at the pane's width wherever the measured speeds' digits put it;
        # auto's first drafts wait for its probe budget, so two 40-token answers may draft
        # nothing (the long answer below shows acceptance in the live panel)
        flat = " ".join(text.split())
        assert "vs plain" in flat and "(measured" in flat

        # slash commands: /stats shows the KV reuse of the second turn; a bad /draft is refused
        pane.send("/stats")
        text = pane.wait(lambda s: "last prompt" in s and prompts(s) == 4, "/stats")
        m = re.search(r"last prompt\s+(\d+) tokens, (\d+) evaluated", text)
        assert m and int(m.group(2)) < int(m.group(1)) / 2, m and m.group(0)
        assert re.search(r"turns\s+2 \(2 in context, 0 dropped\)", text)
        pane.send("/draft 99")
        text = pane.wait(lambda s: "draft must be in 0..64, got 99" in s and prompts(s) == 5,
                         "the /draft error")

        # a long answer: the live panel shows, then Ctrl-C stops the answer, not the session
        pane.send("/max-tokens 100000")
        pane.wait(lambda s: "max tokens: 100000" in s and prompts(s) == 6, "/max-tokens")
        pane.send("tell me a very long story")
        live = pane.wait(lambda s: "tok/s now" in s and "by position" in s, "the live panel",
                         full=False)
        live_escapes = pane.screen(escapes=True)
        assert "accepted" in live and "draft ≤" in live and "vs plain" in live
        assert not colour_codes(live_escapes), "NO_COLOR is set but the screen has colours"
        pane.key("C-c")
        text = pane.wait(lambda s: "answer stopped" in s and prompts(s) == 7, "the stopped answer")
        assert not pane.exited()
        stopped_screen = pane.screen()

        # the session goes on after Ctrl-C
        pane.send("/max-tokens 20")
        pane.wait(lambda s: "max tokens: 20" in s and prompts(s) == 8, "/max-tokens 20")
        pane.send("are you still there?")
        text = pane.wait(lambda s: summaries(s) == 4 and prompts(s) == 9, "an answer after Ctrl-C")

        # one Ctrl-C at the prompt only warns
        pane.key("C-c")
        pane.wait(lambda s: "Ctrl-C again or Ctrl-D to exit" in s.split(">>> are you still there?")[-1]
                  and prompts(s) == 10, "the Ctrl-C warning")
        assert not pane.exited()

        pane.send("/exit")
        text = pane.wait(lambda s: "[exit status" in s, "the exit")
        assert "Bye.\n[exit status 0]" in text, text[-500:]
        final = pane.screen()
        if keep:
            out = Path(keep)
            out.mkdir(parents=True, exist_ok=True)
            (out / "live.txt").write_text(live)
            (out / "stopped.txt").write_text(stopped_screen)
            (out / "final.txt").write_text(final)
            (out / "history.txt").write_text(pane.history())
    finally:
        pane.kill()


def test_chat_through_a_pipe(tiny_models, tmp_path):
    """Not a terminal: no live display, plain text; bad input is reported and the chat goes on;
    end of input (Ctrl-D) exits cleanly."""
    script = "hello\n/nope\n/draft 65\n\n/temp hot\n/strategy none\nplain now\n/stats\n"
    env = {**os.environ, "NO_COLOR": "1", "TANDEM_HOME": str(tmp_path / "home"),
           "COLUMNS": "100"}
    res = subprocess.run(
        [sys.executable, "-m", "tandem", "chat", "-m", str(tiny_models["target"]),
         "-md", str(tiny_models["draft"]), "-t", "1", "-n", "12"],
        input=script, capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "\x1b[" not in out
    assert "unknown command /nope" in out
    assert "draft must be in 0..64, got 65" in out
    assert "empty message" in out
    assert "temp needs a number" in out
    assert "strategy: none" in out and "tokens · plain decoding" in out
    assert summaries(out) == 2
    assert "Bye." in out and "Error:" not in res.stderr
    # the first answer kept for drafting says so, once, with how to turn it off
    assert out.count("tandem keeps its answers in") == 1
    assert "--no-history" in out and "tandem history clear" in out
    assert (tmp_path / "home" / "history" / ".noted").is_file()
