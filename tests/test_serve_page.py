"""The chat page served at `GET /` by mode=serve, driven in a real headless Chromium.

Needs Debian's `chromium` and `chromium-driver` and the `selenium` package. Without them the
test is skipped on a developer's machine, but fails in CI (where `CI` is set). With
MM_SCREENSHOT=1 it also saves a screenshot of the answered page to docs/chat-page.png.
"""
from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest

from serving import ROOT, serving

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
    with serving(tmp_path_factory.mktemp("serve"), "max_new_tokens=8") as running:
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
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1000,760", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
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


def test_chat_page_streams_an_answer_about_an_image(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server + "/")
    wait = WebDriverWait(browser, 60)
    # the page asks /v1/models for the model id first
    wait.until(lambda d: d.find_element(By.ID, "model").text not in ("", "connecting…"))
    assert not browser.find_elements(By.CSS_SELECTOR, ".error"), browser.find_element(By.ID, "messages").text

    browser.find_element(By.ID, "attach").send_keys(str(ROOT / "examples" / "shapes.png"))
    wait.until(lambda d: d.find_element(By.ID, "pending").is_displayed())
    assert "shapes.png" in browser.find_element(By.ID, "pending").text

    browser.find_element(By.ID, "input").send_keys("What shapes are in this picture?")
    browser.find_element(By.ID, "send").click()

    def finished(d):
        errors = d.find_elements(By.CSS_SELECTOR, ".error")
        if errors:
            raise AssertionError("the page shows an error: " + " | ".join(e.text for e in errors))
        return d.find_elements(By.CSS_SELECTOR, '.assistant[data-done="1"]')

    answer = wait.until(finished)[0]
    assert answer.find_element(By.CSS_SELECTOR, ".content").text.strip()
    stats = answer.find_element(By.CSS_SELECTOR, ".stats").text
    assert "TTFT" in stats and "tok/s" in stats, stats
    user = browser.find_element(By.CSS_SELECTOR, ".user")
    assert user.find_elements(By.TAG_NAME, "img"), "the sent image is shown in the user bubble"
    assert "What shapes" in user.text
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
