"""Docs that work offline (issue 40, item 5): the built site read from disk in a real browser, and
``diff2 docs --serve``'s port.

The browser tests build the site, open three pages (the home page, the configuration reference, a
tutorial) from ``file://`` in Debian's headless Chromium (``/usr/bin/chromium``, driven by
playwright; ``.ci/run`` installs it) and check what a reader sees: the search box is there and
finds a word with no network, no request leaves the machine, no key of the configuration table is
broken over two lines, and no code block hides part of a line. Screenshots of the three pages go to
a temporary folder (printed). Without Chromium or playwright those tests are skipped, saying why.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from diff2_flwr.cli import docs, main
from diff2_flwr.runtime.config import config_keys

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
#: Chromium's flags: headless, no sandbox (CI runs as root), and nothing of its own on the network.
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _listening(port: int = 0) -> socket.socket:
    """A socket listening on 127.0.0.1:``port`` (0: any free port): a port someone else holds."""
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", port))
    held.listen()
    return held


# ------------------------------------------------------------------------------ --serve's port

def test_the_default_port_is_not_the_superlinks():
    assert docs.DEFAULT_PORT != 8000
    for compose in ROOT.glob("docker-compose*.yml"):
        assert f":{docs.DEFAULT_PORT}" not in compose.read_text(), compose.name


def test_a_taken_default_port_gives_a_free_one_and_says_so():
    try:
        held = _listening(docs.DEFAULT_PORT)
    except OSError:  # taken already (another process here): the case under test
        held = None
    try:
        assert not docs.port_free(docs.DEFAULT_PORT)
        port, note = docs.serve_port(None)
        assert port != docs.DEFAULT_PORT and docs.port_free(port)
        assert note == (f"port {docs.DEFAULT_PORT} is in use: serving on the free port {port} "
                        f"instead")
    finally:
        if held is not None:
            held.close()


def test_a_free_port_asked_for_is_used_as_it_is():
    with _listening() as probe:
        port = probe.getsockname()[1]
    assert docs.serve_port(port) == (port, "")


def test_a_taken_port_asked_for_is_one_line_before_the_build(tmp_path, capsys):
    with _listening() as held:
        port = held.getsockname()[1]
        code = main(["docs", "--serve", "--port", str(port), "--out", str(tmp_path / "site")])
    captured = capsys.readouterr()
    assert code == 1
    report = json.loads(captured.out)  # one JSON object on stdout
    assert report["status"] == "failed" and f"port {port} on 127.0.0.1 is in use" in report["error"]
    assert captured.err.splitlines() == [f"diff2 docs: error: {report['error']}"]
    assert "--port" in report["error"] and "Traceback" not in captured.err
    assert not (tmp_path / "site").exists()  # it failed before building


# Slow: the tests below build the whole site (mkdocs, ~10 s) and start a real server or headless
# Chromium (a few seconds per page), which is what they check; the fast tier keeps the port logic.

@pytest.mark.slow
def test_serve_with_the_default_port_taken_serves_on_the_port_it_prints(tmp_path):
    """`diff2 docs --serve` as a user runs it, with 8765 taken: the JSON's URL serves the site."""
    try:
        held = _listening(docs.DEFAULT_PORT)
    except OSError:
        held = None
    serving = subprocess.Popen(
        [sys.executable, "-m", "diff2_flwr.cli", "docs", "--serve", "--out", str(tmp_path / "s")],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        report = json.loads(serving.stdout.readline())
        assert report["status"] == "serving", report
        port = int(re.fullmatch(r"http://127\.0\.0\.1:(\d+)/", report["url"]).group(1))
        assert port != docs.DEFAULT_PORT
        deadline, page = time.monotonic() + 120, None
        while page is None and time.monotonic() < deadline:  # mkdocs serve builds, then listens
            assert serving.poll() is None, serving.stderr.read()
            try:
                with urllib.request.urlopen(report["url"] + "index.html", timeout=5) as answer:
                    page = answer.read().decode()
            except OSError:
                time.sleep(0.5)
        assert page is not None and "diff2-flwr" in page
    finally:
        serving.send_signal(signal.SIGINT)  # Ctrl-C: mkdocs removes its temporary build
        try:
            _, err = serving.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            serving.kill()
            _, err = serving.communicate()
        if held is not None:
            held.close()
    assert f"port {docs.DEFAULT_PORT} is in use: serving on the free port {port}" in err
    assert f"Serving on {report['url']}" in err and "Traceback" not in err


@pytest.mark.slow
def test_a_port_taken_after_the_check_is_one_line_not_a_traceback(capsys):
    with _listening() as held:
        port = held.getsockname()[1]
        url = f"http://127.0.0.1:{port}/"
        assert docs._serve(url, f"127.0.0.1:{port}") == 1
    err = capsys.readouterr().err
    assert f"diff2 docs: error: could not serve on {url}" in err and "Traceback" not in err


# ------------------------------------------------------------------------------ the site in a
# browser, from file://

def _playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (the test extra: pip install -e '.[test]')")
    if not CHROMIUM.is_file():
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium; .ci/run "
                    f"installs it)")
    return sync_playwright


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs") / "site"
    done = docs.build(out)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def browser():
    sync_playwright = _playwright()
    with sync_playwright() as driver:
        chromium = driver.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def reader(browser):
    """A fresh desktop-sized tab; ``reader.requests`` is every URL it asked for."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    requests: list[str] = []
    context.on("request", lambda request: requests.append(request.url))
    page = context.new_page()
    page.set_default_timeout(20_000)
    page.requests = requests
    yield page
    context.close()


#: Page -> a word on it, on few other pages, that the search must find (a result links to the page).
PAGES = {
    "index.html": "differentially",
    "reference/configuration.html": "separators",
    "tutorials/first-run.html": "jq",
}

#: Requests that stay on this machine.
LOCAL = ("file:", "data:", "blob:", "about:")


@pytest.mark.slow
@pytest.mark.parametrize("path", PAGES)
def test_a_page_read_from_disk_searches_offline(site, reader, path, tmp_path):
    reader.goto((site / path).as_uri())
    shot = tmp_path / (Path(path).stem + ".png")
    reader.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")
    word = PAGES[path]
    assert re.search(rf"\b{word}\b", reader.inner_text("article"), flags=re.I), (
        f"{path} no longer has the word {word!r}: choose another for PAGES")
    box = reader.locator("input.md-search__input")
    assert box.is_visible(), "no search box: the theme hides it when its search worker fails"
    box.click()
    reader.keyboard.type(word)
    results = reader.locator(".md-search-result__item")
    results.first.wait_for()
    links = [results.nth(i).locator("a").first.get_attribute("href")
             for i in range(results.count())]
    page = urlsplit((site / path).as_uri()).path
    assert any(urlsplit(link).path == page for link in links), links
    left = [url for url in reader.requests if not url.startswith(LOCAL)]
    assert not left, f"requests that left the machine: {left}"


#: Each row of the configuration table: its key, and how many line boxes each <code> of the row
#: (the key, the default) takes.
ROWS = """() => [...document.querySelectorAll('.md-typeset table tbody tr')].map(row => [
    row.querySelector('td code').textContent,
    [...row.querySelectorAll('code')].map(code => code.getClientRects().length)])"""


@pytest.mark.slow
@pytest.mark.parametrize("width", [1280, 1024, 390])
def test_no_key_of_the_configuration_table_breaks_over_two_lines(site, reader, width):
    reader.set_viewport_size({"width": width, "height": 900})
    reader.goto((site / "reference" / "configuration.html").as_uri())
    rows = dict(reader.evaluate(ROWS))
    assert list(rows) == config_keys()
    assert {key: lines for key, lines in rows.items() if set(lines) != {1}} == {}
    if width >= 1024:  # the whole table fits a laptop's page: nothing to scroll sideways
        frame = reader.evaluate("""() => { const w = document.querySelector(
            '.md-typeset__scrollwrap'); return [w.scrollWidth, w.clientWidth]; }""")
        assert frame[0] <= frame[1], frame


#: Each code block: [its width of content, its visible width, overflow-x, white-space, lines as
#: written, lines as drawn].
CODE_BLOCKS = """() => [...document.querySelectorAll('.md-content pre > code')].map(code => {
    const style = getComputedStyle(code);
    const drawn = Math.round((code.clientHeight - parseFloat(style.paddingTop)
                              - parseFloat(style.paddingBottom)) / parseFloat(style.lineHeight));
    return [code.scrollWidth, code.clientWidth, style.overflowX, style.whiteSpace,
            code.textContent.replace(/\\n$/, '').split('\\n').length, drawn];
})"""


@pytest.mark.slow
@pytest.mark.parametrize("path", PAGES)
def test_no_code_block_hides_part_of_a_line(site, reader, path):
    reader.goto((site / path).as_uri())
    blocks = reader.evaluate(CODE_BLOCKS)
    assert blocks or path == "index.html"
    for scroll, visible, overflow, white_space, _, _ in blocks:
        assert scroll <= visible, f"a code block {scroll} px wide in {visible} px shows a part"
        assert overflow in ("auto", "scroll") and white_space == "pre-wrap"
    if path == "tutorials/first-run.html":  # it has lines longer than the page: they wrapped
        assert any(drawn > written for *_, written, drawn in blocks), blocks
