"""The chat page served at `GET /` by mode=serve, driven in a real headless Chromium.

Needs Debian's `chromium` and `chromium-driver` and the `selenium` package. Without them the
test is skipped on a developer's machine, but fails in CI (where `CI` is set). With
MM_SCREENSHOT=1 it also saves a screenshot of the answered page to docs/chat-page.png: the embedded
default (trained on pipeline/tiny/shapes.py's task) naming the shapes in the task's example image.

Tool calls and reasoning are rendered from a fake OpenAI server of the test's own (``FakeOpenAI``)
that serves the real chat.html and answers with canned chunks in OpenAI's / vLLM's shapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import threading
import time
from typing import Iterator

import httpx
import pytest
from fastapi import Request  # at module level: the routes' annotations are strings (__future__ annotations)

from serving import ROOT, free_port, serving

CHROMEDRIVER = "/usr/bin/chromedriver"


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _have_browser() -> bool:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return False
    return _chromium() is not None and os.access(CHROMEDRIVER, os.X_OK)


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    response = httpx.get(url, timeout=timeout)
    return response.status_code, response.content


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # room for the shapes answer ("a blue triangle and a red circle" is 13 tokens, then end of turn)
    with serving(tmp_path_factory.mktemp("serve"), "max_new_tokens=24") as running:
        yield running.url


@pytest.fixture
def browser():
    if not _have_browser():
        if not os.environ.get("CI"):
            pytest.skip("needs chromium, chromium-driver (/usr/bin/chromedriver) and selenium")
        pytest.fail("CI is set but chromium, chromium-driver or selenium is missing")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = _chromium()
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1000,760",
        "--force-device-scale-factor=1",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    # the page's own area at 1000x760 (the window's frame would take part of --window-size)
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride", {"width": 1000, "height": 760, "deviceScaleFactor": 1, "mobile": False}
    )
    try:
        yield driver
    finally:
        driver.quit()


def test_page_is_served(server):
    status, body = _get(server + "/")
    assert status == 200
    page = body.decode()
    for needle in ('id="input"', 'id="send"', 'id="new-chat"', 'id="attach"', 'id="messages"'):
        assert needle in page
    status, body = _get(server + "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"]


def test_chat_page_streams_an_answer_about_an_image(server, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    from pipeline.tiny.shapes import SHAPES_QUESTION, answer, example

    # the embedded default's task: its example image, drawn by the task's own generator, and its question
    image, shapes = example()
    picture = tmp_path / "shapes.png"
    image.save(picture)
    expected = answer(SHAPES_QUESTION, shapes)  # "a blue triangle and a red circle"

    browser.get(server + "/")
    wait = WebDriverWait(browser, 60)
    # the page asks /v1/models for the model id first
    wait.until(lambda d: d.find_element(By.ID, "model").text not in ("", "connecting…"))
    assert not browser.find_elements(By.CSS_SELECTOR, ".error"), browser.find_element(By.ID, "messages").text

    browser.find_element(By.ID, "attach").send_keys(str(picture))
    wait.until(lambda d: d.find_element(By.ID, "pending").is_displayed())
    assert "shapes.png" in browser.find_element(By.ID, "pending").text

    browser.find_element(By.ID, "input").send_keys(SHAPES_QUESTION)
    browser.find_element(By.ID, "send").click()

    def finished(d):
        errors = d.find_elements(By.CSS_SELECTOR, ".error")
        if errors:
            raise AssertionError("the page shows an error: " + " | ".join(e.text for e in errors))
        return d.find_elements(By.CSS_SELECTOR, '.assistant[data-done="1"]')

    reply = wait.until(finished)[0]
    assert reply.find_element(By.CSS_SELECTOR, ".content").text.strip() == expected
    assert not reply.find_elements(By.CSS_SELECTOR, ".reasoning, .tool-call")
    stats = reply.find_element(By.CSS_SELECTOR, ".stats").text
    assert "TTFT" in stats and "tok/s" in stats, stats
    user = browser.find_element(By.CSS_SELECTOR, ".user")
    assert user.find_elements(By.TAG_NAME, "img"), "the sent image is shown in the user bubble"
    assert SHAPES_QUESTION in user.text
    assert not browser.find_element(By.ID, "pending").is_displayed(), "the attachment was consumed"

    if os.environ.get("MM_SCREENSHOT") == "1":
        out = ROOT / "docs" / "chat-page.png"
        out.parent.mkdir(exist_ok=True)
        browser.save_screenshot(str(out))

    # a second turn (sent with Enter) goes out with the whole conversation; New chat empties the page
    browser.find_element(By.ID, "input").send_keys("And the colours?", Keys.ENTER)
    WebDriverWait(browser, 60).until(lambda d: len(finished(d)) == 2)
    browser.find_element(By.ID, "new-chat").click()
    assert not browser.find_elements(By.CSS_SELECTOR, "#messages > *")


@pytest.mark.slow  # the key itself is checked over HTTP in test_serve (suite time)
def test_chat_page_asks_for_the_api_key(tmp_path, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    with serving(tmp_path, "max_new_tokens=8", "serve.api_key=page-test-key") as running:
        base = running.url
        browser.get(base + "/")
        wait = WebDriverWait(browser, 60)
        wait.until(lambda d: d.find_element(By.ID, "keybar").is_displayed())  # /v1/models said 401
        browser.find_element(By.ID, "api-key").send_keys("wrong-key", Keys.ENTER)
        wait.until(lambda d: "rejected" in d.find_element(By.ID, "key-msg").text)
        browser.find_element(By.ID, "api-key").send_keys("page-test-key", Keys.ENTER)
        wait.until(lambda d: d.find_element(By.ID, "model").text not in ("", "connecting…", "API key required"))
        assert not browser.find_element(By.ID, "keybar").is_displayed()
        assert browser.execute_script("return localStorage.getItem('mm-pipeline-api-key')") == "page-test-key"

        browser.find_element(By.ID, "input").send_keys("Hello", Keys.ENTER)
        answer = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, '.assistant[data-done="1"]'))[0]
        assert not browser.find_elements(By.CSS_SELECTOR, ".error"), browser.find_element(By.ID, "messages").text
        assert answer.find_element(By.CSS_SELECTOR, ".content").text.strip()
        assert "TTFT" in answer.find_element(By.CSS_SELECTOR, ".stats").text


# --- tool calls and reasoning, from a fake server ----------------------------------------------

CHAT_HTML = ROOT / "pipeline" / "serve" / "static" / "chat.html"
REASONING = ["The user asks about ", "Paris: I need the weather", " and the local time."]
WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'
TIME_ARGS = '{"tz": "Europe/Paris"}'


class FakeOpenAI:
    """A stand-in for an OpenAI-compatible server that answers a user message with reasoning and
    two tool calls (finish_reason "tool_calls"), and a conversation holding tool results with text.
    Streams in OpenAI's / vLLM's chunk shapes; holds a streamed answer after its reasoning until
    ``release`` is set, so the page can be looked at mid-stream."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.release = threading.Event()

    @staticmethod
    def chunk(delta: dict | None, finish: str | None = None, **extra) -> str:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        body = {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "fake-tools",
            "choices": choices,
            **extra,
        }
        return "data: " + json.dumps(body) + "\n\n"

    def stream_tool_calls(self) -> list[str]:
        head = [self.chunk({"role": "assistant", "content": ""})]
        head += [self.chunk({"reasoning_content": r}) for r in REASONING]
        tail = [  # id, type and name first, then argument fragments per index, interleaved
            self.chunk(
                {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_0",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": ""},
                        }
                    ]
                }
            ),
            self.chunk(
                {
                    "tool_calls": [
                        {
                            "index": 1,
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_time", "arguments": ""},
                        }
                    ]
                }
            ),
            self.chunk({"tool_calls": [{"index": 0, "function": {"arguments": WEATHER_ARGS[:10]}}]}),
            self.chunk({"tool_calls": [{"index": 1, "function": {"arguments": TIME_ARGS[:12]}}]}),
            self.chunk({"tool_calls": [{"index": 0, "function": {"arguments": WEATHER_ARGS[10:]}}]}),
            self.chunk({"tool_calls": [{"index": 1, "function": {"arguments": TIME_ARGS[12:]}}]}),
            self.chunk({}, "tool_calls"),
            self.chunk(None, usage={"prompt_tokens": 12, "completion_tokens": 23, "total_tokens": 35}),
            "data: [DONE]\n\n",
        ]
        return [head, tail]

    def stream_text(self, text: str) -> list[str]:
        words = text.split(" ")
        return [
            [self.chunk({"role": "assistant", "content": ""})]
            + [self.chunk({"content": w if i == 0 else " " + w}) for i, w in enumerate(words)]
            + [self.chunk({}, "stop"), "data: [DONE]\n\n"]
        ]

    def app(self):
        from fastapi import FastAPI
        from fastapi.responses import FileResponse, StreamingResponse

        app = FastAPI()

        @app.get("/")
        def page():
            return FileResponse(CHAT_HTML, media_type="text/html")

        @app.get("/v1/models")
        def models():
            return {
                "object": "list",
                "data": [{"id": "fake-tools", "object": "model", "created": 0, "owned_by": "test"}],
            }

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.requests.append(body)
            results = any(m.get("role") == "tool" for m in body["messages"])
            if body.get("stream"):
                parts = self.stream_text("It is 18 °C and sunny in Paris.") if results else self.stream_tool_calls()

                async def events():
                    for i, part in enumerate(parts):
                        if i:  # hold after the reasoning until the test has looked
                            deadline = time.monotonic() + 30
                            while not self.release.is_set() and time.monotonic() < deadline:
                                await asyncio.sleep(0.02)
                        for line in part:
                            yield line
                            await asyncio.sleep(0.01)

                return StreamingResponse(events(), media_type="text/event-stream")
            if results:
                message = {"role": "assistant", "content": "Cold and clear in Oslo."}
                finish = "stop"
            else:
                message = {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "Oslo is in Norway.",
                    "tool_calls": [
                        {
                            "id": "call_9",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                        },
                        {"id": "call_10", "type": "function", "function": {"name": "lookup", "arguments": "city=Oslo"}},
                    ],
                }
                finish = "tool_calls"
            return {
                "id": "chatcmpl-fake",
                "object": "chat.completion",
                "created": 0,
                "model": "fake-tools",
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
                "usage": {"prompt_tokens": 9, "completion_tokens": 17, "total_tokens": 26},
                "metrics": {"ttft_s": 0.012, "decode_tok_s": 123.4},
            }

        return app


@contextlib.contextmanager
def fake_server(fake: FakeOpenAI) -> Iterator[str]:
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(fake.app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the fake server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        fake.release.set()
        server.should_exit = True
        thread.join(15)


def _text(element) -> str:
    """An element's text whether or not it is rendered (a closed <details> hides its body)."""
    return element.get_property("textContent")


def test_chat_page_shows_reasoning_folded_and_tool_calls_as_cards(browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    fake = FakeOpenAI()
    with fake_server(fake) as base:
        browser.get(base + "/")
        wait = WebDriverWait(browser, 30)
        wait.until(lambda d: d.find_element(By.ID, "model").text == "fake-tools")

        def answers(d, n):
            errors = d.find_elements(By.CSS_SELECTOR, ".error")
            if errors:
                raise AssertionError("the page shows an error: " + " | ".join(e.text for e in errors))
            done = d.find_elements(By.CSS_SELECTOR, '.assistant[data-done="1"]')
            return done if len(done) == n else None

        # streamed: reasoning first, held there by the server
        assert browser.find_element(By.ID, "stream").is_selected()
        browser.find_element(By.ID, "input").send_keys("What is the weather in Paris?", Keys.ENTER)
        wait.until(
            lambda d: _text(d.find_element(By.CSS_SELECTOR, ".assistant .reasoning .think")) == "".join(REASONING)
        )
        live = browser.find_element(By.CSS_SELECTOR, ".assistant .reasoning")
        assert live.tag_name == "details" and not live.get_property("open"), "the reasoning is folded"
        assert live.find_element(By.TAG_NAME, "summary").text == "Thinking…"
        assert not browser.find_elements(By.CSS_SELECTOR, '.assistant[data-done="1"]')
        fake.release.set()

        reply = wait.until(lambda d: answers(d, 1))[0]
        details = reply.find_element(By.CSS_SELECTOR, "details.reasoning")
        assert not details.get_property("open")
        assert details.find_element(By.TAG_NAME, "summary").text == "Reasoning"
        assert _text(reply.find_element(By.CSS_SELECTOR, ".content")) == "", "no reasoning in the answer"
        assert "Paris: I need" not in reply.text and "(empty answer)" not in reply.text
        cards = reply.find_elements(By.CSS_SELECTOR, ".tool-call")
        assert [c.find_element(By.CSS_SELECTOR, ".tool-name").text for c in cards] == ["get_weather", "get_time"]
        args = [c.find_element(By.CSS_SELECTOR, ".tool-args").text for c in cards]
        assert args[0] == json.dumps(json.loads(WEATHER_ARGS), indent=2), args  # assembled per index, pretty
        assert json.loads(args[1]) == {"tz": "Europe/Paris"} and "\n" in args[1], args
        stats = reply.find_element(By.CSS_SELECTOR, ".stats").text
        assert "TTFT" in stats and "tok/s" in stats and "23 tokens" in stats, stats
        details.find_element(By.TAG_NAME, "summary").click()  # unfolds
        assert details.get_property("open")
        assert details.find_element(By.CSS_SELECTOR, ".think").text == "".join(REASONING)

        # the next request carries the calls back (content null) and a tool message for each
        cards[0].find_element(By.CSS_SELECTOR, ".tool-result").send_keys('{"temp_c": 18}')
        browser.find_element(By.ID, "input").send_keys("Thanks. So?", Keys.ENTER)
        reply = wait.until(lambda d: answers(d, 2))[1]
        assert reply.find_element(By.CSS_SELECTOR, ".content").text == "It is 18 °C and sunny in Paris."
        assert not reply.find_elements(By.CSS_SELECTOR, ".reasoning, .tool-call")
        assert fake.requests[1]["stream"] is True
        assert fake.requests[1]["messages"] == [
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_0",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": WEATHER_ARGS},
                    },
                    {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": TIME_ARGS}},
                ],
            },
            {"role": "tool", "tool_call_id": "call_0", "content": '{"temp_c": 18}'},
            {"role": "tool", "tool_call_id": "call_1", "content": "(no result)"},
            {"role": "user", "content": "Thanks. So?"},
        ]
        assert all(c.find_element(By.CSS_SELECTOR, ".tool-result").get_property("readOnly") for c in cards)

        # not streamed: the same rendering from a whole chat.completion
        browser.find_element(By.ID, "new-chat").click()
        browser.find_element(By.ID, "stream").click()
        browser.find_element(By.ID, "input").send_keys("And in Oslo?", Keys.ENTER)
        reply = wait.until(lambda d: answers(d, 1))[0]
        assert fake.requests[2]["stream"] is False and "stream_options" not in fake.requests[2]
        details = reply.find_element(By.CSS_SELECTOR, "details.reasoning")
        assert not details.get_property("open")
        assert details.find_element(By.TAG_NAME, "summary").text == "Reasoning"
        assert _text(details.find_element(By.CSS_SELECTOR, ".think")) == "Oslo is in Norway."
        cards = reply.find_elements(By.CSS_SELECTOR, ".tool-call")
        assert [c.find_element(By.CSS_SELECTOR, ".tool-name").text for c in cards] == ["get_weather", "lookup"]
        assert cards[0].find_element(By.CSS_SELECTOR, ".tool-args").text == '{\n  "city": "Oslo"\n}'
        assert cards[1].find_element(By.CSS_SELECTOR, ".tool-args").text == "city=Oslo"  # not JSON: as sent
        stats = reply.find_element(By.CSS_SELECTOR, ".stats").text
        assert "TTFT 0.012 s" in stats and "123.4 tok/s" in stats and "17 tokens" in stats, stats

        # tool results alone (Enter in a result box, no message) continue the turn
        cards[1].find_element(By.CSS_SELECTOR, ".tool-result").send_keys("Oslo, Norway")
        cards[0].find_element(By.CSS_SELECTOR, ".tool-result").send_keys("-3 °C", Keys.ENTER)
        reply = wait.until(lambda d: answers(d, 2))[1]
        assert reply.find_element(By.CSS_SELECTOR, ".content").text == "Cold and clear in Oslo."
        assert fake.requests[3]["messages"][1:] == [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_9",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                    },
                    {"id": "call_10", "type": "function", "function": {"name": "lookup", "arguments": "city=Oslo"}},
                ],
            },
            {"role": "tool", "tool_call_id": "call_9", "content": "-3 °C"},
            {"role": "tool", "tool_call_id": "call_10", "content": "Oslo, Norway"},
        ]
        assert len(browser.find_elements(By.CSS_SELECTOR, ".user")) == 1, "no empty user bubble"
