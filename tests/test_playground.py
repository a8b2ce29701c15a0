"""The chat playground at / of the OpenAI front, in headless Chromium (harness/browser.py, the DevTools protocol)
against the real tritonserver: a message streams in, a long reply is stopped (and its Triton request aborted),
the model is switched, thinking and tool calls are shown apart, hostile replies render as text, --api-key is
asked for and kept in session storage only, and nothing is fetched from another origin.

Setup: Debian's `chromium` package (scripts/setup.sh installs it where apt-get may run as root)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import requests
from openai import OpenAI

from harness.browser import Browser, find_chromium
from harness.openai_front import Front
from helpers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.server,
              pytest.mark.skipif(find_chromium() is None,
                                 reason="headless browser missing: install the Debian package chromium")]
API_KEY = "playground-key"
HOSTILE = "<script>window.__pwned=1</script><img src=x onerror=window.__pwned=2> **bold** `a<b>`"
SCREENSHOT = ROOT / "docs" / "img" / "playground.png"


@pytest.fixture(scope="module")
def front(triton, tmp_path_factory):
    server = Front(triton.grpc_url, tmp_path_factory.mktemp("playground") / "front.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser():
    with Browser() as b:
        yield b


def js(value) -> str:
    return json.dumps(value)


def open_page(b: Browser, url: str) -> None:
    b.goto(url + "/")
    b.wait_for("document.querySelectorAll('#model option').length > 0 || !document.getElementById('key-panel').hidden")


def settings(b: Browser, **values) -> None:
    for name, value in values.items():
        if isinstance(value, bool):
            b.eval(f"(() => {{ const e = document.getElementById({js(name)}); if (e.checked !== {js(value)}) e.click(); }})()")
        else:
            b.eval(f"(() => {{ const e = document.getElementById({js(name)}); e.value = {js(str(value))}; "
                   f"e.dispatchEvent(new Event('change')); }})()")


def send(b: Browser, text: str) -> int:
    """Types a message and presses Send; returns the index of its reply."""
    n = b.eval("window.playground.replies.length")
    b.eval(f"document.getElementById('input').value = {js(text)}; document.getElementById('send').click()")
    b.wait_for(f"window.playground.replies.length > {n}")
    return n


def reply(b: Browser, i: int) -> dict:
    return b.eval(f"(() => {{ const r = window.playground.replies[{i}]; return {{content: r.content, "
                  f"reasoning: r.reasoning, calls: r.calls, usage: r.usage, finish: r.finish, state: r.div.dataset.state, "
                  f"stats: r.stats.textContent, role: r.div.querySelector('.role').textContent, "
                  f"text: r.contentDiv.textContent, thinkingHidden: r.thinking.hidden }}; }})()")


def wait_done(b: Browser, i: int, timeout: float = 120) -> dict:
    b.wait_for(f"window.playground.replies[{i}].div.dataset.state", timeout)
    return reply(b, i)


def api(front: Front, key: str = "unused") -> OpenAI:
    return OpenAI(base_url=f"{front.url}/v1", api_key=key, max_retries=0, timeout=120)


def test_the_page_and_its_files_come_from_the_front_with_a_strict_policy(front, browser):
    r = requests.get(f"{front.url}/", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "default-src 'none'" in csp
    for path in ("playground.js", "markdown.js", "playground.css"):
        assert requests.get(f"{front.url}/playground/{path}", timeout=10).status_code == 200
    assert requests.get(f"{front.url}/playground/../app.py", timeout=10).status_code == 404
    open_page(browser, front.url)
    models = browser.eval("[...document.querySelectorAll('#model option')].map(o => o.value)")
    assert models == [m.id for m in api(front).models.list()] == ["qwen3_a8w8", "qwen3_tq"]
    urls = browser.requests()
    assert urls and all(u.startswith(front.url) for u in urls), urls   # offline: nothing from elsewhere


def test_a_message_streams_in_and_equals_the_whole_reply(front, browser):
    open_page(browser, front.url)
    settings(browser, thinking=False, temperature=0, max_tokens=160, seed=1)
    # the reply's text length at every change of the page, to see it arrive in pieces
    browser.eval("window.__lengths = []; new MutationObserver(() => { const r = window.playground.replies.at(-1); "
                 "if (r) window.__lengths.push(r.content.length); }).observe(document.getElementById('messages'), "
                 "{subtree: true, childList: true, characterData: true})")
    i = send(browser, "Tell me about the Forbidden City.")
    got = wait_done(browser, i)
    whole = api(front).chat.completions.create(
        model="qwen3_a8w8", messages=[{"role": "user", "content": "Tell me about the Forbidden City."}], max_tokens=160,
        temperature=0, top_p=0.8, seed=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert got["state"] == "done" and got["content"] == whole.choices[0].message.content
    assert got["usage"]["completion_tokens"] == whole.usage.completion_tokens
    lengths = sorted(set(browser.eval("window.__lengths")) - {0})
    # it arrived in pieces, not at once: the page showed part of the reply before the whole (the page draws once
    # per animation frame, so a fast host shows few intermediate states)
    assert len(lengths) >= 2 and lengths[0] < lengths[-1], lengths
    assert got["role"] == "qwen3_a8w8"
    assert "TTFT" in got["stats"] and "prompt tokens" in got["stats"] and "tokens/s" in got["stats"]


def test_stop_aborts_a_long_reply_and_frees_its_pages(triton, front, browser):
    model = "qwen3_tq"
    open_page(browser, front.url)
    settings(browser, model=model, thinking=False, temperature=0, max_tokens=900)
    aborted = triton.finished_total(model, "abort")
    i = send(browser, "Write a very long story.")
    browser.wait_for(f"window.playground.replies[{i}].content.length > 20", 60)
    assert triton.wait_until(lambda: triton.metric("vllm:kv_cache_pages_used", model) > 0, 5)
    browser.eval("document.getElementById('stop').click()")
    got = wait_done(browser, i, 10)
    assert got["state"] == "stopped" and "stopped" in got["stats"] and got["usage"] is None
    assert triton.wait_until(lambda: triton.metric("vllm:kv_cache_pages_used", model) == 0, 3)
    assert triton.wait_until(lambda: triton.finished_total(model, "abort") == aborted + 1, 3)
    assert browser.eval("!document.getElementById('send').disabled && document.getElementById('stop').disabled")


def test_switching_the_model_and_a_second_turn_carries_the_history(triton, front, browser):
    open_page(browser, front.url)
    settings(browser, thinking=False, temperature=0, max_tokens=8, system="You are terse.")
    first = wait_done(browser, send(browser, "Hi!"))
    before = triton.metric("vllm:prompt_tokens_total", "qwen3_tq")
    settings(browser, model="qwen3_tq")
    second = wait_done(browser, send(browser, "And again?"))
    assert (first["role"], second["role"]) == ("qwen3_a8w8", "qwen3_tq")
    assert triton.metric("vllm:prompt_tokens_total", "qwen3_tq") == before + second["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"] + 4   # the first turn went along


def test_thinking_is_shown_apart_and_folds(front, browser):
    open_page(browser, front.url)
    settings(browser, thinking=True, temperature=0, max_tokens=12)
    got = wait_done(browser, send(browser, "Think about 2+2."))
    whole = api(front).chat.completions.create(model="qwen3_a8w8", messages=[{"role": "user", "content": "Think about 2+2."}],
                                               max_tokens=12, temperature=0, top_p=0.8,
                                               extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    msg = whole.choices[0].message
    assert got["reasoning"] == msg.reasoning_content and not got["thinkingHidden"]
    assert got["content"] == (msg.content or "")
    toggled = browser.eval("(() => { const d = window.playground.replies.at(-1).thinking; const was = d.open; "
                           "d.querySelector('summary').click(); return [was, d.open]; })()")
    assert toggled[0] != toggled[1]


def test_tool_calls_are_shown_as_calls(front, browser):
    open_page(browser, front.url)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}}}]   # bounded arguments: a random-weights model ends its call
    settings(browser, thinking=False, temperature=0, max_tokens=80, tools_mode=True, tools=json.dumps(tools),
             tool_choice="required")
    got = wait_done(browser, send(browser, "Weather in Paris?"))
    assert got["finish"] == "tool_calls" and got["calls"][0]["function"]["name"] == "get_weather"
    shown = browser.eval("[...window.playground.replies.at(-1).callsDiv.querySelectorAll('.tool-name')]"
                         ".map(e => e.textContent)")
    assert shown == ["tool call: get_weather"]
    json.loads(got["calls"][0]["function"]["arguments"])


def test_a_hostile_reply_is_rendered_as_text(front, browser):
    """The model is made to answer with markup (a JSON-schema enum of one hostile string): it shows as text, and
    neither its script nor its image handler runs."""
    open_page(browser, front.url)
    settings(browser, thinking=False, temperature=0, max_tokens=80, json_mode=True,
             schema=json.dumps({"type": "string", "enum": [HOSTILE]}))
    got = wait_done(browser, send(browser, "Say something."))
    assert json.loads(got["content"]) == HOSTILE
    assert "<script>window.__pwned=1</script>" in got["text"] and "<img src=x onerror=" in got["text"]
    time.sleep(0.3)   # an image error handler would have fired by now
    assert browser.eval("document.querySelectorAll('#messages script, #messages img, #messages [onerror]').length") == 0
    assert browser.eval("typeof window.__pwned") == "undefined"
    # the markdown renderer itself, on hostile markdown: code, emphasis and markup all stay text
    rendered = browser.eval(
        "(() => { const d = document.createElement('div'); renderMarkdown('# T <b>x</b>\\n\\n**b** <i>i</i> `<s>`\\n\\n"
        "```html\\n<script>window.__pwned=3</script>\\n```\\n- <img src=x onerror=window.__pwned=4>', d); "
        "document.body.appendChild(d); return {html: d.innerHTML, tags: [...d.querySelectorAll('*')].map(e => e.tagName)}; })()")
    assert set(rendered["tags"]) <= {"H3", "P", "STRONG", "CODE", "PRE", "UL", "LI", "BR", "EM"}, rendered
    assert "&lt;script&gt;" in rendered["html"] and "&lt;img" in rendered["html"]
    time.sleep(0.3)
    assert browser.eval("typeof window.__pwned") == "undefined"


def test_the_api_key_is_asked_for_and_kept_in_the_session_only(triton, browser, tmp_path):
    keyed = Front(triton.grpc_url, tmp_path / "keyed.log", "--api-key", API_KEY)
    try:
        open_page(browser, keyed.url)
        assert browser.eval("!document.getElementById('key-panel').hidden")
        assert browser.eval("document.querySelectorAll('#model option').length") == 0
        browser.eval(f"document.getElementById('key-input').value = {js(API_KEY)}; "
                     "document.getElementById('key-form').requestSubmit()")
        browser.wait_for("document.querySelectorAll('#model option').length === 2")
        assert browser.eval(f"sessionStorage.getItem('qwen3-playground-api-key') === {js(API_KEY)}")
        assert browser.eval("localStorage.length") == 0 and browser.eval("document.cookie") == ""
        settings(browser, thinking=False, temperature=0, max_tokens=4)
        got = wait_done(browser, send(browser, "Hi"))
        assert got["state"] == "done" and got["usage"]["completion_tokens"] == 4
    finally:
        browser.eval("sessionStorage.clear()")
        keyed.stop()


def test_screenshot_of_a_conversation(front, browser, tmp_path):
    """A screenshot for the docs: tmp_path always; docs/img/playground.png with QWEN3_UPDATE_SCREENSHOTS=1."""
    open_page(browser, front.url)
    settings(browser, thinking=True, temperature=0.7, max_tokens=24, seed=3, system="You are a helpful assistant.")
    wait_done(browser, send(browser, "What is the Forbidden City?"))
    settings(browser, thinking=False, max_tokens=32)
    wait_done(browser, send(browser, "Answer in one sentence."))
    shot = browser.screenshot(tmp_path / "playground.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    if os.environ.get("QWEN3_UPDATE_SCREENSHOTS") == "1":
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        SCREENSHOT.write_bytes(shot.read_bytes())
