"""The chat page in a real browser: Debian's headless chromium driven through its own
chromedriver by selenium (`make setup-browser` installs both; nothing is downloaded when
the tests run). The page talks to a tiny-model server that drafts with n-grams and
suffixes: a random-weight model soon repeats itself, so its replies always have drafts."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from specserve.loading.model import LoadedModel
from tests.server.conftest import LiveServer, start_server

selenium = pytest.importorskip("selenium", reason="the dev extra's selenium")
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.slow
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
KEY = "sekret"
SPEC_TYPES = ("ngram-map-k", "suffix")


def make_driver() -> webdriver.Chrome:
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("no chromium + chromedriver on PATH: run `make setup-browser`")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",  # root in a container
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1100,820",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
    ):
        options.add_argument(flag)
    # an explicit driver path: selenium's own manager, which downloads drivers, never runs
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)


@pytest.fixture(scope="module")
def driver() -> Iterator[webdriver.Chrome]:
    d = make_driver()
    yield d
    d.quit()


@pytest.fixture(scope="module")
def spec_server(tiny_model: LoadedModel) -> Iterator[LiveServer]:
    server = start_server(tiny_model, parallel=2, spec_types=SPEC_TYPES)
    yield server
    server.stop()


def until(driver: webdriver.Chrome, check: Any, timeout: float = 60) -> Any:
    return WebDriverWait(driver, timeout, poll_frequency=0.02).until(check)


def open_page(driver: webdriver.Chrome, server: LiveServer) -> None:
    driver.get(server.url + "/")
    driver.execute_script("localStorage.clear()")  # each test starts from a fresh page
    driver.get(server.url + "/")
    until(driver, lambda d: d.find_element(By.ID, "input").is_displayed())


def settings(driver: webdriver.Chrome, max_tokens: int, compare: bool = False) -> None:
    driver.find_element(By.CSS_SELECTOR, "#settings summary").click()
    field = driver.find_element(By.ID, "max-tokens")
    field.clear()
    field.send_keys(str(max_tokens))
    if compare:
        driver.find_element(By.ID, "compare").click()


def send(driver: webdriver.Chrome, text: str) -> None:
    driver.find_element(By.ID, "input").send_keys(text, Keys.ENTER)


def idle(driver: webdriver.Chrome) -> bool:
    return "busy" not in (driver.find_element(By.TAG_NAME, "body").get_attribute("class") or "")


def texts(driver: webdriver.Chrome, css: str, attribute: str = "textContent") -> list[str]:
    """What the elements matching css hold now, read in one go: the page repaints the
    conversation as a reply streams in, so an element found earlier may be gone."""
    script = "return [...document.querySelectorAll(arguments[0])].map(e => e[arguments[1]])"
    return driver.execute_script(script, css, attribute)


def stored(driver: webdriver.Chrome) -> list[dict[str, Any]]:
    """The conversation as the page keeps it in localStorage."""
    return driver.execute_script("return JSON.parse(localStorage.getItem('specserve.chat'))")[
        "messages"
    ]


def greedy_reply(server: LiveServer, text: str, max_tokens: int) -> str:
    body = {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "speculative": {"types": []},
    }
    got = httpx2.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    return got.json()["choices"][0]["message"]["content"]


@pytest.mark.smoke
def test_a_reply_streams_in_with_its_drafts_shaded(
    driver: webdriver.Chrome, spec_server: LiveServer
) -> None:
    open_page(driver, spec_server)
    settings(driver, max_tokens=80)
    send(driver, "hello")
    reply = ".msg.assistant .body"
    until(driver, lambda d: "".join(texts(d, reply)).strip())
    until(driver, idle)
    drafted = texts(driver, f"{reply} span.d", "title")
    assert drafted, "no text shaded as drafted"
    assert set(drafted) <= {f"drafted by {t}" for t in SPEC_TYPES}
    assert texts(driver, "#legend")[0].startswith("drafted by")
    assert "tok/s" in texts(driver, "#stats")[0]
    messages = stored(driver)
    assert messages[1]["content"] == greedy_reply(spec_server, "hello", 80)
    assert "".join(text for text, _ in messages[1]["segments"]) == messages[1]["content"]


def test_speculation_off_gives_the_same_text_and_both_speeds(
    driver: webdriver.Chrome, spec_server: LiveServer, tmp_path: Path
) -> None:
    open_page(driver, spec_server)
    settings(driver, max_tokens=120, compare=True)
    send(driver, "Write *quicksort* in `C`")
    until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ".compare .verdict.same"))
    until(driver, idle)
    sides = texts(driver, ".compare .side")
    assert len(sides) == 2 and all("tok/s" in s for s in sides)
    reply = stored(driver)[1]
    assert reply["plain"]["content"] == reply["content"] != ""
    assert reply["stats"]["drafted"] > 0 and reply["plain"]["stats"]["drafted"] == 0
    assert texts(driver, ".msg.assistant .body span.d")
    assert texts(driver, ".msg.user .body em") == ["quicksort"]  # Markdown rendered
    shot = tmp_path / "chat.png"
    assert driver.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the conversation outlives a reload (localStorage); Clear empties it
    driver.refresh()
    until(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg")) == 2)
    assert driver.find_elements(By.CSS_SELECTOR, ".compare .verdict.same")
    driver.find_element(By.ID, "clear").click()
    assert not driver.find_elements(By.CSS_SELECTOR, ".msg") and stored(driver) == []


def test_stop_ends_the_reply_where_it_is(driver: webdriver.Chrome, spec_server: LiveServer) -> None:
    open_page(driver, spec_server)
    settings(driver, max_tokens=480)
    send(driver, "hello")
    until(driver, lambda d: "".join(texts(d, ".msg.assistant .body")).strip())
    driver.find_element(By.ID, "stop").click()
    until(driver, idle)
    reply = stored(driver)[1]
    assert reply["finish"] == "stopped" and 0 < len(reply["content"]) < 480
    assert "stopped" in texts(driver, ".msg.assistant .meta")[0]


def test_markdown_is_escaped_before_it_is_rendered(
    driver: webdriver.Chrome, spec_server: LiveServer
) -> None:
    open_page(driver, spec_server)
    render = "return Markdown.render(arguments[0], null)"
    html = driver.execute_script(render, "<img src=x onerror=alert(1)> [a](javascript:alert(1))")
    assert "<img" not in html and "href" not in html and "&lt;img" in html
    html = driver.execute_script(render, "```python\nif a < b:\n    pass\n```")
    assert "<pre><code>if a &lt; b:\n    pass</code></pre>" in html
    html = driver.execute_script(render, "[docs](https://example.org/a?b=1&c=2)")
    assert 'href="https://example.org/a?b=1&amp;c=2"' in html


def test_the_page_asks_for_the_api_key(driver: webdriver.Chrome, tiny_model: LoadedModel) -> None:
    server = start_server(tiny_model, parallel=1, api_key=KEY)
    try:
        open_page(driver, server)
        until(driver, lambda d: d.find_element(By.ID, "keyform").is_displayed())
        assert "API key" in driver.find_element(By.ID, "key-why").text
        driver.find_element(By.ID, "key").send_keys(KEY, Keys.ENTER)
        until(driver, lambda d: not d.find_element(By.ID, "keyform").is_displayed())
        assert driver.find_element(By.ID, "model").text == "tiny"
        settings(driver, max_tokens=20)
        send(driver, "hello")
        until(driver, idle)
        until(driver, lambda d: len(stored(d)) == 2 and stored(d)[1]["content"])
    finally:
        server.stop()
