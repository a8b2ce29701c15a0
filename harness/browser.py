"""Headless Chromium driven over the Chrome DevTools Protocol, for the browser tests.

Hand-written rather than selenium or playwright: Chromium's --remote-debugging-pipe speaks CDP as
NUL-terminated JSON messages on file descriptors 3 (commands in) and 4 (replies and events out), so a
client is a pipe pair and json, with no driver binary matched to the browser's version (Debian's
chromium-driver) and no browser download (playwright). Only what the tests use: open a page, evaluate
JavaScript (awaiting promises), wait for a condition, click and type through the page's DOM, take a
screenshot.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


def _pipe_fds(commands: int, replies: int) -> None:
    """In the child: the command pipe on fd 3 and the reply pipe on fd 4, as --remote-debugging-pipe expects
    (moved out of the way first, in case either already sits on 3 or 4)."""
    commands, replies = os.dup(commands), os.dup(replies)
    os.dup2(commands, 3)
    os.dup2(replies, 4)


class BrowserError(RuntimeError):
    pass


class Browser:
    """One headless Chromium with one page (tab). Use as a context manager."""

    def __init__(self, binary: str | None = None, width: int = 1280, height: int = 900):
        binary = binary or find_chromium()
        if binary is None:
            raise BrowserError("no Chromium found (Debian package: chromium)")
        self._profile = tempfile.mkdtemp(prefix="cdp-profile-")
        cmd_r, cmd_w = os.pipe()    # we write commands -> browser's fd 3
        out_r, out_w = os.pipe()    # browser writes replies on fd 4 -> we read
        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
             "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check", "--disable-extensions",
             "--disable-background-networking", "--disable-sync", "--mute-audio", f"--window-size={width},{height}",
             f"--user-data-dir={self._profile}", "about:blank"],
            pass_fds=(3, 4), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=lambda: _pipe_fds(cmd_r, out_w))
        os.close(cmd_r)
        os.close(out_w)
        self._out = os.fdopen(cmd_w, "wb", buffering=0)
        self._in = os.fdopen(out_r, "rb", buffering=0)
        self._next_id = 0
        self._replies: dict[int, dict] = {}
        self.events: list[dict] = []
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.session = None
        target = self.command("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.command("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Network"):
            self.command(f"{domain}.enable")

    def _read(self) -> None:
        buf = b""
        while True:
            chunk = self._in.read(65536)
            if not chunk:
                break
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                with self._cv:
                    if "id" in msg:
                        self._replies[msg["id"]] = msg
                    else:
                        self.events.append(msg)
                    self._cv.notify_all()
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def command(self, method: str, timeout: float = 60.0, **params) -> dict:
        with self._cv:
            self._next_id += 1
            msg_id = self._next_id
        msg = {"id": msg_id, "method": method, "params": params}
        if self.session is not None and not method.startswith("Target."):
            msg["sessionId"] = self.session
        self._out.write(json.dumps(msg).encode() + b"\0")
        deadline = time.time() + timeout
        with self._cv:
            while msg_id not in self._replies:
                left = deadline - time.time()
                if left <= 0 or getattr(self, "_closed", False):
                    raise BrowserError(f"{method}: no reply")
                self._cv.wait(left)
            reply = self._replies.pop(msg_id)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def goto(self, url: str, timeout: float = 30.0) -> None:
        self.command("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'", timeout)

    def eval(self, expression: str, timeout: float = 60.0):
        """The value of a JavaScript expression (a promise is awaited); a thrown error raises BrowserError."""
        res = self.command("Runtime.evaluate", timeout=timeout, expression=expression, awaitPromise=True,
                           returnByValue=True)
        if "exceptionDetails" in res:
            details = res["exceptionDetails"]
            raise BrowserError(details.get("exception", {}).get("description") or details.get("text"))
        return res["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0, poll: float = 0.05):
        """Polls a JavaScript expression until it is truthy; returns its value."""
        deadline = time.time() + timeout
        while True:
            try:
                value = self.eval(expression)
            except BrowserError:
                value = None
            if value:
                return value
            if time.time() > deadline:
                raise TimeoutError(f"not true after {timeout} s: {expression}")
            time.sleep(poll)

    def screenshot(self, path: Path) -> Path:
        data = self.command("Page.captureScreenshot", format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def requests(self) -> list[str]:
        """URLs of every request the page made (Network.requestWillBeSent events)."""
        with self._cv:
            return [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"]

    def close(self) -> None:
        try:
            self.command("Browser.close", timeout=5)
        except BrowserError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.close()
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
