"""The web console at /ui, driven by a real browser (Debian's chromium through Playwright)
against a real `qiao serve` on the built-in demo model.

- the playground streams a chat answer (the text grows in the page while the stream runs) equal
  to the same greedy request made through the official `openai` client; completions too;
- the dashboard's figures move under load sent from the test (tokens/s, finished requests,
  TTFT percentiles, a batch job's progress);
- the models page shows a new version after a reload through the management listener's
  console, sets traffic weights, and the main listener's page shows both versions;
- with --api-key the console asks for the key, refuses a wrong one and works with the right one.

Screenshots go to $QIAO_CONSOLE_SCREENSHOTS when set (scripts/console_screenshots.py sets it to
docs/console/), else to a temporary folder.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from qiao.api.console import CSP
from qiao.api.settings import DEMO_MODEL_DIR

from .conftest import SubprocessServer, http_client, openai_client
from .test_repository_serving import TOKEN, free_port

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip(
        "no /usr/bin/chromium: the console tests drive Debian's chromium "
        "(./dev setup installs it, or: apt-get install chromium)",
        allow_module_level=True,
    )
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is in the dev extra: pip install -e '.[dev]'"
)

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
API_KEY = "console-test-key-0123456789"
MODEL = "demo_model"
QUESTION = "My lord, the queen is dead."  # a 13-token greedy answer
# A bound for a hung page on a loaded 2-core machine, not a speed check.
WAIT_MS = 90_000


# --- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    """`qiao serve` on the built-in demo model, behind an API key."""
    root = tmp_path_factory.mktemp("console")
    server = SubprocessServer(
        [
            "--model",
            str(DEMO_MODEL_DIR),
            "--api-key",
            API_KEY,
            "--data-dir",
            str(root / "data"),
            "--log-interval",
            "0",
            "--drain-timeout",
            "2",
        ],
        root / "server.log",
    )
    try:
        yield server.wait_ready()
    finally:
        server.stop()
    assert "Traceback" not in server.log(), server.log()[-3000:]


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = os.environ.get("QIAO_CONSOLE_SCREENSHOTS")
    path = Path(folder) if folder else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


class Page:
    """A fresh browser context and page; the page's script errors and CSP refusals fail the
    test that made it."""

    def __init__(self, browser: Any, *, key: tuple[str, str] | None = None) -> None:
        self.context = browser.new_context(viewport={"width": 1280, "height": 860})
        self.context.set_default_timeout(WAIT_MS)
        if key is not None:
            storage_key, value = key
            # Before any script of the page: as if the key had been given in this tab already.
            self.context.add_init_script(
                f"sessionStorage.setItem({json.dumps(storage_key)}, {json.dumps(value)})"
            )
        self.page = self.context.new_page()
        self.problems: list[str] = []
        self.page.on("pageerror", lambda error: self.problems.append(f"script error: {error}"))
        self.page.on("console", self._console)

    def _console(self, message: Any) -> None:
        if "Content Security Policy" in message.text or "Refused to" in message.text:
            self.problems.append(f"CSP: {message.text}")

    def close(self) -> None:
        self.context.close()
        assert not self.problems, self.problems


@pytest.fixture
def open_page(browser: Any) -> Iterator[Any]:
    pages: list[Page] = []

    def make(**kwargs: Any) -> Any:
        pages.append(Page(browser, **kwargs))
        return pages[-1].page

    yield make
    for page in pages:
        page.close()


def keyed(open_page: Any) -> Any:
    return open_page(key=("qiao.apiKey", API_KEY))


def number(text: str) -> float:
    return float(text.replace(",", "").split()[0])


def wait_for_number_above(page: Any, selector: str, floor: float) -> float:
    """Wait until the number shown in `selector` is above `floor`; returns it."""
    page.wait_for_function(
        """([selector, floor]) => {
            const node = document.querySelector(selector);
            const value = node && parseFloat(node.textContent.replaceAll(",", ""));
            return Number.isFinite(value) && value > floor;
        }""",
        arg=[selector, floor],
    )
    return number(page.locator(selector).inner_text())


def record_answer_growth(page: Any) -> None:
    """From now on, the page keeps every text the newest answer showed while it streamed."""
    page.evaluate(
        """() => {
            window.answerTexts = [];
            new MutationObserver(() => {
                const answers = document.querySelectorAll(".turn.assistant .text");
                const last = answers[answers.length - 1];
                if (last && last.dataset.state === "streaming") {
                    window.answerTexts.push(last.textContent);
                }
            }).observe(document.getElementById("pg-transcript"),
                       {childList: true, subtree: true, characterData: true});
        }"""
    )


def assert_grew_incrementally(page: Any, final: str) -> None:
    seen = page.evaluate("() => window.answerTexts")
    partial = {text for text in seen if text and text != final}
    assert partial, f"the answer never showed part of its text while streaming: {seen}"
    assert all(final.startswith(text) for text in partial), (partial, final)
    assert len(partial) >= 2, f"the answer appeared in one piece: {seen}"


def ask(page: Any, text: str) -> str:
    """Send `text` from the playground; the answer's text once the stream is done."""
    page.fill("#pg-input", text)
    record_answer_growth(page)
    page.click("#pg-send")
    answer = page.locator(".turn.assistant .text").last
    page.wait_for_function(
        """() => [...document.querySelectorAll(".turn.assistant .text")].at(-1)
                 ?.dataset.state !== "streaming" """
    )
    assert answer.get_attribute("data-state") == "done", page.inner_text("#pg-error")
    return answer.evaluate("node => node.textContent")


# --- the playground ------------------------------------------------------------------------------


def test_playground_streams_chat_as_the_openai_client_answers(
    server: SubprocessServer, open_page: Any, shots: Path
) -> None:
    client = openai_client(server.base_url, API_KEY)
    expected = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=64,
    )
    page = keyed(open_page)
    page.goto(server.base_url + "/ui#playground")
    page.wait_for_selector("#pg-model[data-loaded]")
    assert page.input_value("#pg-model") == MODEL
    page.fill("#pg-temperature", "0")
    page.fill("#pg-max_tokens", "64")
    page.check("#pg-logprobs")

    text = ask(page, QUESTION)
    assert text == expected.choices[0].message.content
    assert_grew_incrementally(page, text)
    chunks = int(page.locator(".turn.assistant .text").last.get_attribute("data-chunks") or 0)
    # One chunk per token that shows text (the end-of-sequence token shows none).
    assert 1 < chunks <= expected.usage.completion_tokens
    usage = page.locator("#pg-usage [data-usage=completion] b").inner_text()
    assert int(usage) == expected.usage.completion_tokens
    finish = page.locator("#pg-usage [data-usage=finish] b").inner_text()
    assert finish == expected.choices[0].finish_reason

    # Logprobs: one span per token, coloured by probability; hovering shows the alternatives.
    tokens = page.locator(".turn.assistant .tok")
    assert tokens.count() == chunks
    tokens.nth(2).hover()
    alternatives = page.locator("#pg-token-detail tbody tr")
    assert alternatives.count() == 5
    assert page.locator("#pg-token-detail tr.chosen").count() == 1
    page.screenshot(path=str(shots / "playground.png"))


def test_playground_streams_completions_as_the_openai_client_answers(
    server: SubprocessServer, open_page: Any
) -> None:
    prompt = "ROMEO: But soft, what light"
    client = openai_client(server.base_url, API_KEY)
    expected = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=40)
    page = keyed(open_page)
    page.goto(server.base_url + "/ui#playground")
    page.wait_for_selector("#pg-model[data-loaded]")
    page.click("#pg-mode-completion")
    assert page.inner_text("#pg-route") == "POST /v1/completions"
    page.fill("#pg-temperature", "0")
    page.fill("#pg-max_tokens", "40")
    text = ask(page, prompt)
    assert text == expected.choices[0].text
    assert_grew_incrementally(page, text)
    total = page.locator("#pg-usage [data-usage=total] b").inner_text()
    assert int(total) == expected.usage.total_tokens


# --- the dashboard -------------------------------------------------------------------------------


class Load:
    """Threads sending completions to the server until stopped."""

    def __init__(self, base_url: str, num_threads: int = 2) -> None:
        self.base_url = base_url
        self.stopped = threading.Event()
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._run) for _ in range(num_threads)]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stopped.set()
        for thread in self.threads:
            thread.join()

    def _run(self) -> None:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        body = {"model": MODEL, "prompt": "To be, or not to be", "max_tokens": 24}
        with http_client(self.base_url, headers=headers, timeout=60) as client:
            while not self.stopped.is_set():
                response = client.post("/v1/completions", json=body)
                if response.status_code != 200:
                    self.failures.append(response.text)


def start_batch(server: SubprocessServer, num_lines: int) -> str:
    client = openai_client(server.base_url, API_KEY)
    lines = b"".join(
        json.dumps(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"Speak, herald {i}!"}],
                    "max_tokens": 16,
                },
            }
        ).encode()
        + b"\n"
        for i in range(num_lines)
    )
    upload = client.files.create(file=("lines.jsonl", lines), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return batch.id


def test_dashboard_figures_move_under_load(
    server: SubprocessServer, open_page: Any, shots: Path
) -> None:
    page = keyed(open_page)
    page.goto(server.base_url + "/ui#dashboard")
    page.select_option("#dash-interval", "1000")
    row = f'#dash-versions tr[data-version="{MODEL}@1"]'
    finished = f'{row} td[data-field="finished"]'
    page.wait_for_selector(finished)
    before = number(page.inner_text(finished))
    with Load(server.base_url) as load:
        rate = wait_for_number_above(page, "#dash-tokens-rate", 0)
        assert rate > 0
        wait_for_number_above(page, f'{row} td[data-field="tokens-rate"]', 0)
        wait_for_number_above(page, finished, before)
        # TTFT percentiles over the window, from the histogram buckets.
        page.wait_for_function(
            """(row) => /\\d/.test(document.querySelector(row).children[5].textContent)""",
            arg=row,
        )
        page.wait_for_selector("#dash-ready .badge.good")
        batch_id = start_batch(server, num_lines=4)
        page.wait_for_selector(f'#dash-batches tr[data-batch="{batch_id}"]')
        # A few polls under load drawn in the tokens/s sparkline, for the screenshot.
        page.wait_for_function(
            "() => document.querySelector('#dash-spark polyline').points.numberOfItems >= 6"
        )
        page.screenshot(path=str(shots / "dashboard.png"), full_page=True)
    assert not load.failures, load.failures[:3]
    progress = f'#dash-batches tr[data-batch="{batch_id}"] td[data-field="progress"]'
    page.wait_for_function(
        "(selector) => document.querySelector(selector)?.textContent === '4 / 4'", arg=progress
    )
    status = f'#dash-batches tr[data-batch="{batch_id}"] .badge'
    page.wait_for_function(
        "(selector) => document.querySelector(selector)?.textContent === 'completed'", arg=status
    )
    split = page.locator(f'#dash-split [data-model="{MODEL}"]').inner_text()
    assert "v1 100 %" in split


METRICS_TEXT = """# HELP x A histogram.
# TYPE x histogram
x_bucket{le="0.1",model_name="m",version="1"} 5.0
x_bucket{le="0.5",model_name="m",version="1"} 10.0
x_bucket{le="+Inf",model_name="m",version="1"} 10.0
x_bucket{le="0.1",model_name="m",version="2"} 5.0
x_bucket{le="+Inf",model_name="m",version="2"} 10.0
y_total{model_name="m",version="1",finished_reason="stop"} 3.0
y_total{model_name="m",version="1",finished_reason="length"} 4.0
z{model_name="a\\"b",version="2"} 1.5e+00
"""


def test_dashboard_arithmetic_is_prometheus_arithmetic(
    server: SubprocessServer, open_page: Any
) -> None:
    """The console's parser and histogram_quantile, run in the page on a known text."""
    page = keyed(open_page)
    page.goto(server.base_url + "/ui#models")
    got = page.evaluate(
        """async (text) => {
            const prom = await import("/ui/prom.js");
            const samples = prom.parseMetrics(text);
            const h = prom.histograms(samples, "x");
            const v1 = h.get("m@1");
            const before = v1.map((b) => ({le: b.le, count: b.count - 1}));
            return {
                q50: prom.quantile(0.5, v1),
                q75: prom.quantile(0.75, v1),
                q99: prom.quantile(0.99, v1),
                inInf: prom.quantile(0.9, h.get("m@2")),
                delta: prom.bucketDelta(v1, before).map((b) => b.count),
                sum: prom.sumBy(samples, "y_total").get("m@1"),
                escaped: prom.sumBy(samples, "z").get('a"b@2'),
                rate: prom.rate(30, 10, 4),
                reset: prom.rate(5, 10, 5),
                empty: prom.quantile(0.5, [{le: 1, count: 0}, {le: Infinity, count: 0}]),
            };
        }""",
        METRICS_TEXT,
    )
    # Linear within the bucket the rank falls in: rank 7.5 of 10 in (0.1, 0.5] -> 0.3.
    assert got["q50"] == pytest.approx(0.1)
    assert got["q75"] == pytest.approx(0.3)
    assert got["q99"] == pytest.approx(0.1 + 0.4 * 4.9 / 5)
    assert got["inInf"] == pytest.approx(0.1)  # in +Inf: the highest finite bound
    assert got["delta"] == [1, 1, 1]
    assert got["sum"] == 7 and got["escaped"] == 1.5
    assert got["rate"] == 5 and got["reset"] == 1  # a counter reset counts from zero
    assert math.isnan(got["empty"])  # no observations


# --- the API key ---------------------------------------------------------------------------------


def test_console_asks_for_the_key_when_one_is_set(server: SubprocessServer, open_page: Any) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        # The shell is open to anyone and holds no data; every data route still needs the key.
        shell = client.get("/ui")
        assert shell.status_code == 200
        assert shell.headers["content-security-policy"] == CSP
        assert "demo_model" not in shell.text and API_KEY not in shell.text
        assert client.get("/ui/console.js").headers["content-type"].startswith("text/javascript")
        assert client.get("/ui/nothing.js").status_code == 404
        assert client.post("/ui").status_code == 405
        root = client.get("/")
        assert root.status_code == 307 and root.headers["location"] == "/ui"
        assert client.post("/").status_code == 401
        for path in ("/metrics", "/v1/models", "/v1/batches", "/version"):
            assert client.get(path).status_code == 401, path

    page = open_page()
    page.goto(server.base_url + "/")  # the redirect
    dialog = page.locator("#key-dialog")
    dialog.wait_for(state="visible")
    assert page.url.endswith("/ui")
    assert "needs an API key" in page.inner_text("#key-message")

    page.fill("#key-input", "not-the-key-0123456789")
    page.click("#key-submit")
    page.wait_for_function(
        "() => document.querySelector('#key-message').textContent.includes('refused')"
    )
    assert dialog.is_visible()
    assert page.locator("#pg-model option").count() == 0

    page.fill("#key-input", API_KEY)
    page.click("#key-submit")
    page.wait_for_selector("#pg-model[data-loaded]")
    assert dialog.is_hidden()
    assert page.input_value("#pg-model") == MODEL
    assert page.evaluate("() => sessionStorage.getItem('qiao.apiKey')") == API_KEY

    # Kept for the tab: a reload asks no more; forgetting it asks again.
    page.reload()
    page.wait_for_selector("#pg-model[data-loaded]")
    assert dialog.is_hidden()
    page.click("#auth-forget")
    dialog.wait_for(state="visible")


# --- the models page -----------------------------------------------------------------------------


def add_version(root: Path, version: str) -> None:
    # Copied beside the repository and moved in, so no scan sees a half-written folder.
    staging = root.parent / f"staging-{version}"
    shutil.copytree(DEMO_MODEL_DIR, staging)
    staging.rename(root / "demo" / version)


@pytest.fixture
def platform(tmp_path: Path) -> Iterator[tuple[SubprocessServer, str, Path]]:
    """A repository with the demo model as `demo` (version 1), in explicit mode: only the
    management API loads and reloads. Yields the server, the management URL, the repository."""
    root = tmp_path / "repo"
    (root / "demo").mkdir(parents=True)
    (root / "demo" / "config.yaml").write_text(
        "backend: llm\nversion_policy: all\ntraffic: {1: 100}\n"
        "llm:\n  num_kv_blocks: 64\n  max_num_seqs: 4\n"
    )
    add_version(root, "1")
    management_port = free_port()
    server = SubprocessServer(
        [
            "--model-repository",
            str(root),
            "--model-control-mode",
            "explicit",
            "--load-model",
            "demo",
            "--management-port",
            str(management_port),
            "--management-token",
            TOKEN,
            "--log-interval",
            "0",
            "--drain-timeout",
            "2",
        ],
        tmp_path / "server.log",
    )
    try:
        yield server.wait_ready(), f"http://127.0.0.1:{management_port}", root
    finally:
        server.stop()
    assert "Traceback" not in server.log(), server.log()[-3000:]


def test_models_page_shows_a_new_version_after_a_reload(
    platform: tuple[SubprocessServer, str, Path], open_page: Any, shots: Path
) -> None:
    server, management, root = platform
    with httpx.Client(base_url=management, timeout=30) as client:
        # The shell is served here too; every management route still needs the token.
        shell = client.get("/ui")
        assert shell.status_code == 200 and 'data-listener="management"' in shell.text
        assert client.get("/v1/repository").status_code == 401
        assert client.get("/").status_code == 401  # no redirect past the guard here
    page = open_page()
    page.goto(management + "/ui")  # the models page is the management listener's only page
    page.locator("#key-dialog").wait_for(state="visible")
    assert page.inner_text("#key-title") == "Management token"
    page.fill("#key-input", TOKEN)
    page.click("#key-submit")
    card = page.locator('.model-card[data-model="demo"]')
    card.locator('tr[data-version="1"][data-state="ready"]').wait_for()
    assert card.locator("tbody tr").count() == 1
    assert page.locator("#nav a.on").inner_text() == "Models"

    add_version(root, "2")
    card.get_by_role("button", name="Reload").click()
    card.locator('tr[data-version="2"][data-state="ready"]').wait_for()
    page.wait_for_function(
        "() => document.querySelector('#models-status').textContent.startsWith('reload demo: done')"
    )
    assert "v2 ready" in page.inner_text("#models-status")

    card.locator('input[data-weight="1"]').fill("50")
    card.locator('input[data-weight="2"]').fill("50")
    card.get_by_role("button", name="Set traffic").click()
    card.locator("[data-weights-set]").filter(has_text="v1 50, v2 50").wait_for()
    page.screenshot(path=str(shots / "models.png"), full_page=True)

    # The split holds (smooth weighted round-robin: 2 and 2 of 4), and the main listener's
    # read-only page shows both versions with the requests each served.
    client = openai_client(server.base_url)
    for _ in range(4):
        client.completions.create(model="demo", prompt="Hark", max_tokens=4)
    main = open_page()
    main.goto(server.base_url + "/ui#models")
    main_card = main.locator('.model-card[data-model="demo"]')
    for version in ("1", "2"):
        main_card.locator(f'tr[data-version="{version}"][data-state="ready"]').wait_for()
    shares = [
        main_card.locator(f'tr[data-version="{v}"] td.num').all_inner_texts() for v in ("1", "2")
    ]
    assert shares == [["2", "50 %"], ["2", "50 %"]], shares
    assert "management listener" in main.inner_text("#models-note")
    assert main.locator('.model-card button:has-text("Reload")').count() == 0
