"""The web playground end to end: the page `foveal serve` serves at "/", driven in
headless Chromium (Selenium with the Debian chromium and chromedriver) against a
live server over the tiny checkpoint. The tiny model answers random tokens, so the
tests check streaming, what the page reports from `usage` and error handling, not
what the answers say. Screenshots go to $FOVEAL_TEST_ARTIFACTS (default: each
test's tmp_path); the path is printed."""
from __future__ import annotations

import base64
import os
import shutil
from pathlib import Path

import httpx
import pytest
from speech_clips import espeak_samples
from test_openai_server import MODEL_NAME, LiveServer, engine_stats, make_engine, noise_png
from test_server_media import bytes_http_server, make_clip_bytes

from foveal.entrypoints.openai.api_server import build_app
from foveal.entrypoints.openai.security import SecurityConfig
from foveal.entrypoints.openai.serving_engine import ServerConfig
from foveal.multimodal.media.fetch import MediaFetchConfig
from foveal.stages.service import StagePools
from tests.stages.stage_documents import make_text_pdf

API_KEY = "playground-test-key"
MAX_MEDIA_BYTES = 200_000
WAIT_S = 90  # a bound on each wait for the page, not a performance check

# A file as the browser would hand it to the page: dropped on the chat, or pasted.
_DISPATCH_FILE = """
const [how, payload, name, type] = arguments;
const bytes = Uint8Array.from(atob(payload), (c) => c.charCodeAt(0));
const transfer = new DataTransfer();
transfer.items.add(new File([bytes], name, {type}));
const init = {bubbles: true, cancelable: true};
if (how === "drop") {
  document.getElementById("chat").dispatchEvent(new DragEvent("drop", {...init, dataTransfer: transfer}));
} else {
  document.getElementById("message").dispatchEvent(
    new ClipboardEvent("paste", {...init, clipboardData: transfer}));
}
"""


def chromium():
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if browser is None or driver_path is None:
        pytest.fail("the playground tests drive headless Chromium: apt-get install -y chromium "
                    "chromium-driver (.ci/run installs them)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("the playground tests need Selenium: pip install -e '.[test]'")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,1000"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path=driver_path), options=options)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> str:
    return tiny_checkpoints("tiny-qwen2-vl")


@pytest.fixture(scope="module")
def engine(checkpoint):
    engine = make_engine(checkpoint, max_model_len=2048, kv_cache_memory_bytes=16 << 20,
                         limit_mm_per_prompt={"image": 2, "video": 1})
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def pools():
    with StagePools({"pdf": 1, "asr": 1}) as stage_pools:
        yield stage_pools


def live_server(engine, checkpoint, pools, **config):
    media = MediaFetchConfig(timeout_s=5.0, max_bytes=MAX_MEDIA_BYTES,
                             allowed_media_domains=("127.0.0.1",))  # the test's media server
    config = ServerConfig(served_model_names=(MODEL_NAME,), model_path=checkpoint, media=media,
                          **config)
    return LiveServer(build_app(engine, config, stage_pools=pools))


@pytest.fixture(scope="module")
def server(engine, checkpoint, pools):
    with live_server(engine, checkpoint, pools) as running:
        yield running


@pytest.fixture(scope="module")
def keyed_server(engine, checkpoint, pools):
    with live_server(engine, checkpoint, pools,
                     security=SecurityConfig(api_keys=(API_KEY,))) as running:
        yield running


@pytest.fixture(scope="module")
def driver():
    browser = chromium()
    yield browser
    browser.quit()


@pytest.fixture()
def artifacts(tmp_path, request) -> Path:
    folder = Path(os.environ.get("FOVEAL_TEST_ARTIFACTS") or tmp_path) / request.node.name
    folder.mkdir(parents=True, exist_ok=True)
    print(f"playground screenshots: {folder}")
    return folder


class Page:
    """The playground in the browser, by the ids and data attributes of index.html."""

    def __init__(self, driver, base_url: str, artifacts: Path) -> None:
        from selenium.webdriver.support.ui import WebDriverWait

        self.driver, self.artifacts = driver, artifacts
        self.wait = WebDriverWait(driver, WAIT_S)
        driver.get(base_url)
        self.wait.until(lambda d: d.find_element("css selector", "body").get_attribute("data-ready"))

    def find(self, css: str):
        return self.driver.find_element("css selector", css)

    def find_all(self, css: str) -> list:
        return self.driver.find_elements("css selector", css)

    def shot(self, name: str) -> None:
        self.driver.save_screenshot(str(self.artifacts / f"{name}.png"))

    def fill(self, field_id: str, value) -> None:
        field = self.find(f"#{field_id}")
        field.clear()
        field.send_keys(str(value))

    def attach(self, *paths: Path) -> None:
        expected = len(self.find_all("#drafts li")) + len(paths)
        self.find("#file-input").send_keys("\n".join(str(path) for path in paths))
        self.wait.until(lambda d: len(self.find_all("#drafts li")) == expected)

    def hand_over(self, how: str, content: bytes, name: str, mime: str) -> None:
        """`how`: "drop" (on the chat) or "paste" (from the clipboard)."""
        expected = len(self.find_all("#drafts li")) + 1
        self.driver.execute_script(_DISPATCH_FILE, how, base64.b64encode(content).decode(), name, mime)
        self.wait.until(lambda d: len(self.find_all("#drafts li")) == expected)

    def send(self, text: str):
        """The answer's article once it is done or failed."""
        before = len(self.find_all("article.assistant"))
        self.fill("message", text)
        self.find("#send").click()
        self.wait.until(lambda d: len(self.find_all("article.assistant")) > before)
        answer = self.find_all("article.assistant")[-1]
        self.wait.until(lambda d: answer.get_attribute("data-status") in ("done", "error"))
        return answer


def report_of(answer) -> dict[str, int]:
    report = answer.find_element("css selector", ".report")
    names = ("prompt-tokens", "cached-tokens", "image-tokens", "video-tokens", "completion-tokens",
             "encoder-cache-queries", "encoder-cache-hits")
    return {name: int(report.get_attribute(f"data-{name}")) for name in names}


def plan_rows(answer) -> list:
    return answer.find_elements("css selector", "table.plan tbody tr")


@pytest.mark.browser
def test_uploaded_image_streams_an_answer_and_the_next_turn_hits_the_prefix_cache(
        driver, server, artifacts, tmp_path):
    page = Page(driver, server.base_url, artifacts)
    page.fill("temperature", 1)  # the tiny model's greedy tokens have no text
    page.fill("seed", 7)
    page.fill("max-tokens", 12)
    image = tmp_path / "noise.png"
    image.write_bytes(noise_png((224, 224), seed=1))
    page.attach(image)
    first = page.send("What is in this image?")
    page.shot("1-first-turn")
    assert first.get_attribute("data-status") == "done", first.text
    assert first.find_element("css selector", ".text").text.strip()
    usage = report_of(first)
    assert 2 <= int(first.get_attribute("data-deltas")) <= usage["completion-tokens"]
    assert usage["image-tokens"] > 0 and usage["cached-tokens"] == 0
    assert usage["encoder-cache-queries"] == 1
    [row] = plan_rows(first)
    assert int(row.get_attribute("data-tokens")) == usage["image-tokens"]
    assert "noise.png" in row.text and "224×224" in row.text and "full" in row.text
    assert page.find("#ttft").text.endswith("ms") or page.find("#ttft").text.endswith(" s")
    assert float(page.find("#tokens-per-second").text) > 0

    second = page.send("And what colour is it?")
    page.shot("2-second-turn")
    assert second.get_attribute("data-status") == "done", second.text
    again = report_of(second)
    assert again["cached-tokens"] > 0 and again["image-tokens"] == usage["image-tokens"]
    assert again["prompt-tokens"] > usage["prompt-tokens"]
    assert "prefix cache hit" in second.find_element("css selector", ".report").text
    assert again["encoder-cache-queries"] == 0  # the image lies in the cached prefix
    assert "encoder not run" in second.find_element("css selector", ".report").text
    page.wait.until(lambda d: int(float(page.find("#metric-prompt-tokens").text))
                    >= usage["prompt-tokens"] + again["prompt-tokens"])


@pytest.mark.browser
def test_a_pasted_image_over_the_visual_token_budget_is_downsampled_and_the_plan_says_so(
        driver, server, artifacts):
    page = Page(driver, server.base_url, artifacts)
    page.fill("max-tokens", 4)
    page.fill("max-visual-tokens", 16)
    page.hand_over("paste", noise_png((224, 224), seed=2), "image.png", "image/png")
    answer = page.send("Describe it.")
    page.shot("budget")
    assert answer.get_attribute("data-status") == "done", answer.text
    [row] = plan_rows(answer)
    assert row.get_attribute("data-downsampled") == "true" and "downsampled" in row.text
    assert 0 < int(row.get_attribute("data-tokens")) <= 16
    assert report_of(answer)["image-tokens"] == int(row.get_attribute("data-tokens"))


@pytest.mark.browser
def test_a_video_added_by_url_reports_its_frames_and_video_tokens(driver, server, artifacts):
    page = Page(driver, server.base_url, artifacts)
    page.fill("max-tokens", 4)
    page.fill("fps", 2)
    with bytes_http_server({"clip.mp4": make_clip_bytes(num_frames=8, fps=4)}) as base:
        page.fill("media-url", f"{base}/clip.mp4")
        page.find("#add-url").click()
        assert "video: " in page.find("#drafts li").text
        answer = page.send("What happens?")
    page.shot("video")
    assert answer.get_attribute("data-status") == "done", answer.text
    [row] = plan_rows(answer)
    assert "clip.mp4" in row.text and int(row.get_attribute("data-frames")) >= 2
    assert report_of(answer)["video-tokens"] == int(row.get_attribute("data-tokens")) > 0


@pytest.mark.browser
def test_a_dropped_pdf_and_an_uploaded_audio_clip_reach_the_prompt(
        driver, server, artifacts, tmp_path):
    page = Page(driver, server.base_url, artifacts)
    page.fill("temperature", 0)
    page.fill("max-tokens", 4)
    question = "What do these say?"
    alone = report_of(page.send(question))["prompt-tokens"]
    page.find("#new-chat").click()
    pdf = make_text_pdf([["The secret word is banana."]])
    page.hand_over("drop", pdf, "note.pdf", "application/pdf")
    espeak_samples("Please open the front door.", tmp_path / "door.wav")
    page.attach(tmp_path / "door.wav")
    answer = page.send(question)
    page.shot("pdf-and-audio")
    assert answer.get_attribute("data-status") == "done", answer.text
    user_turn = page.find_all("article.user")[-1].text
    assert "pdf: note.pdf" in user_turn and "audio: door.wav" in user_turn
    assert report_of(answer)["prompt-tokens"] > alone + 10
    stats = engine_stats(server.base_url)
    for stage in ("pdf", "asr"):
        assert stats[f'foveal:stage_items_total{{stage="{stage}"}}'] >= 1


@pytest.mark.browser
def test_an_oversized_file_shows_the_servers_error_and_the_page_keeps_working(
        driver, server, artifacts, tmp_path):
    page = Page(driver, server.base_url, artifacts)
    page.fill("max-tokens", 4)
    big = tmp_path / "big.png"
    big.write_bytes(noise_png((400, 400), seed=3))
    assert big.stat().st_size > MAX_MEDIA_BYTES
    page.attach(big)
    failed = page.send("Too big?")
    page.shot("1-error")
    assert failed.get_attribute("data-status") == "error"
    assert f"the limit is {MAX_MEDIA_BYTES} bytes" in failed.text and "(400)" in failed.text
    assert page.find("#message").get_attribute("value") == "Too big?"  # the draft came back
    page.find("#drafts li .remove").click()
    assert not page.find_all("#drafts li")
    answer = page.send("Then just text.")
    page.shot("2-next-message")
    assert answer.get_attribute("data-status") == "done", answer.text
    assert report_of(answer)["image-tokens"] == 0  # the failed turn left the history


@pytest.mark.browser
def test_with_an_api_key_the_page_asks_for_it_and_then_works(driver, keyed_server, artifacts):
    page = Page(driver, keyed_server.base_url, artifacts)
    page.fill("max-tokens", 4)
    prompt = page.find("#key-prompt")
    page.wait.until(lambda d: prompt.is_displayed())
    page.shot("1-asks-for-the-key")
    refused = page.send("Hello?")
    assert refused.get_attribute("data-status") == "error" and "API key" in refused.text
    page.fill("api-key", API_KEY)
    answer = page.send("Hello?")
    page.shot("2-with-the-key")
    assert answer.get_attribute("data-status") == "done", answer.text
    page.wait.until(lambda d: not prompt.is_displayed())
    assert page.find("#model-name").text == MODEL_NAME
    driver.refresh()
    page.wait.until(lambda d: page.find("#api-key").get_attribute("value") == API_KEY)


def test_the_page_and_its_files_need_no_key_and_no_playground_turns_them_off(
        engine, checkpoint, pools, keyed_server):
    for path, kind in (("/", "text/html"), ("/playground/app.js", "javascript"),
                       ("/playground/style.css", "text/css")):
        response = httpx.get(keyed_server.base_url + path, timeout=10)
        assert response.status_code == 200 and kind in response.headers["content-type"], path
    assert httpx.get(f"{keyed_server.base_url}/v1/models", timeout=10).status_code == 401
    assert httpx.post(f"{keyed_server.base_url}/playground/app.js", timeout=10).status_code == 401
    with live_server(engine, checkpoint, pools, playground=False) as bare:
        assert httpx.get(f"{bare.base_url}/", timeout=10).status_code == 404
        assert httpx.get(f"{bare.base_url}/playground/app.js", timeout=10).status_code == 404


def test_no_playground_flag_reaches_the_server_config():
    from foveal.entrypoints.cli import build_parser
    from foveal.entrypoints.serve import server_config

    def config(*flags):
        return server_config(build_parser().parse_args(["serve", "/models/x", *flags]), "/models/x")

    assert config().playground and not config("--no-playground").playground
