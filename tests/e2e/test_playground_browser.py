"""The playground page in headless Chromium (Debian's chromium + chromedriver, installed by `make test`), driven by
Selenium against a real `tokenspout serve` process: type a prompt, generate, read the tokens' probabilities, hover
a token for its alternatives (raw and processed), move the temperature slider and see the chart change, reproduce a
seeded generation, regenerate from a token, and the page at phone width.  Screenshots of each state are saved
under the test's temp dir.  The oracle for numbers is the API itself: the same request over HTTP."""

from __future__ import annotations

import base64
import os
import shutil
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

CHROMIUM, CHROMEDRIVER = shutil.which("chromium") or "/usr/bin/chromium", "/usr/bin/chromedriver"
KEY = "sk-playground"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`tokenspout serve` in its own process, with an API key (the page is behind it)."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tokenspout.entrypoints.cli", "serve", "--port", str(port),
                                 "--max-model-len", "1024", "--num-threads", "1", "--api-key", KEY],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("tokenspout serve did not become healthy:\n" + log.read_text()[-3000:])
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    assert os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER), \
        "Debian's chromium and chromium-driver are needed (make test installs them)"
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1280,1000",
                f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_script_timeout(120)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    return tmp_path_factory.mktemp("screenshots")


def wait(driver, predicate, timeout: float = 120.0, what: str = "condition"):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.2).until(lambda d: predicate(d), message=what)


def js(driver, script: str, *args):
    return driver.execute_script(script, *args)


def set_value(driver, element_id: str, value: str) -> None:
    """Set an input's value the way a user's edit ends: the value, then input and change events."""
    js(driver, "const el = document.getElementById(arguments[0]); el.value = arguments[1];"
               "el.dispatchEvent(new Event('input', {bubbles: true}));"
               "el.dispatchEvent(new Event('change', {bubbles: true}));", element_id, value)


def generate(driver, seed: int | None = 7, max_tokens: int = 12) -> list[dict]:
    from selenium.webdriver.common.by import By

    set_value(driver, "max_tokens", str(max_tokens))
    set_value(driver, "seed", "" if seed is None else str(seed))
    driver.find_element(By.ID, "generate").click()
    wait(driver, lambda d: d.find_element(By.ID, "status").get_attribute("data-state") in ("done", "error"),
         what="generation to finish")
    assert driver.find_element(By.ID, "error").text == ""
    return tokens(driver)


def tokens(driver) -> list[dict]:
    return js(driver, "return [...document.querySelectorAll('#output .tok')].map(t => ({text: "
                      "t.querySelector('.t').textContent, p: t.dataset.p, shown: t.querySelector('.p').textContent,"
                      "bg: t.style.background}))")


def open_page(driver, served: str) -> None:
    from selenium.webdriver.common.by import By

    host = served.removeprefix("http://")
    driver.get(f"http://user:{KEY}@{host}/")  # the browser answers the Basic challenge with the key
    wait(driver, lambda d: d.find_element(By.ID, "status").get_attribute("data-state") == "ready",
         what="the page to list the model")


def test_the_page_needs_the_key_and_is_an_ordinary_client(served):
    r = httpx.get(served + "/")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")
    assert httpx.get(served + "/v1/models").headers["www-authenticate"] == "Bearer"
    basic = "Basic " + base64.b64encode(f"anyone:{KEY}".encode()).decode()
    page = httpx.get(served + "/playground", headers={"Authorization": basic})
    assert page.status_code == 200 and "tokenspout playground" in page.text
    assert httpx.get(served + "/playground/static/playground.js", headers={"Authorization": basic}).status_code == 200
    wrong = "Basic " + base64.b64encode(b"anyone:nope").decode()
    assert httpx.get(served + "/", headers={"Authorization": wrong}).status_code == 401
    assert httpx.get(served + "/v1/models", headers={"Authorization": basic}).status_code == 200


def test_generate_hover_slide_reproduce_regenerate(served, browser, shots):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    d = browser
    open_page(d, served)
    d.save_screenshot(str(shots / "1-loaded.png"))
    prompt = d.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys("Name three colours.")
    first = generate(d, seed=7)
    d.save_screenshot(str(shots / "2-generated.png"))
    assert len(first) >= 3
    for t in first:  # every token carries its probability, shaded and written as a number
        assert t["p"] is not None and 0.0 < float(t["p"]) <= 1.0
        assert t["shown"].endswith("%") and "hsl" in t["bg"] or "rgb" in t["bg"]
    # The oracle: the same request over HTTP gives the same text (seeded).
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": httpx.get(served + "/v1/models", headers=auth).json()["data"][0]["id"], "max_tokens": 12,
            "seed": 7, "temperature": 1.0, "messages": [{"role": "user", "content": "Name three colours."}]}
    api_text = httpx.post(served + "/v1/chat/completions", json=body, headers=auth, timeout=120).json()
    assert "".join(t["text"] for t in first).replace("↵", "\n") == api_text["choices"][0]["message"]["content"]

    # Hover a token: its alternatives, raw (re-scored) and processed (from the stream).
    target = d.find_elements(By.CSS_SELECTOR, "#output .tok")[2]
    ActionChains(d).move_to_element(target).perform()
    wait(d, lambda dr: len(dr.find_elements(By.CSS_SELECTOR, "#chart .bar-row")) >= 5, what="the chart")
    rows = js(d, "return [...document.querySelectorAll('#details tr.alt')].map(r => "
                 "[...r.children].map(c => c.textContent))")
    assert len(rows) >= 5 and all(r[1].endswith("%") for r in rows)  # raw for each row
    assert any(r[2].endswith("%") for r in rows)  # processed for the streamed top-5
    d.save_screenshot(str(shots / "3-hover.png"))

    # Move the temperature slider: the chart changes, with no new generation.
    def kept():
        return js(d, "return [...document.querySelectorAll('#chart .bar-row')].map(r => Number(r.dataset.kept))")

    before = kept()
    slider = d.find_element(By.ID, "temperature")
    slider.send_keys(*[Keys.ARROW_LEFT] * 14)  # as a user moves it: 1.0 -> 0.3 in steps of 0.05
    assert abs(float(slider.get_attribute("value")) - 0.3) < 1e-9
    after = kept()
    assert after != before and after[0] > before[0]  # cooler: the top token gains
    set_value(d, "top_k", "2")
    cut = js(d, "return [...document.querySelectorAll('#chart .bar-row')].map(r => r.classList.contains('cut'))")
    assert cut[:2] == [False, False] and all(cut[2:])
    d.save_screenshot(str(shots / "4-slider.png"))
    set_value(d, "temperature", "1")
    set_value(d, "top_k", "0")

    # The same seed reproduces the same text.
    again = generate(d, seed=7)
    assert [t["text"] for t in again] == [t["text"] for t in first]
    d.save_screenshot(str(shots / "5-reproduced.png"))

    # Regenerate from a token: the text before it is kept, the rest is new.
    ActionChains(d).move_to_element(d.find_elements(By.CSS_SELECTOR, "#output .tok")[2]).perform()
    wait(d, lambda dr: dr.find_element(By.ID, "regen-here").is_enabled(), what="regenerate button")
    set_value(d, "seed", "99")
    d.find_element(By.ID, "regen-here").click()
    wait(d, lambda dr: dr.find_element(By.ID, "status").get_attribute("data-state") == "done", what="regeneration")
    regen = tokens(d)
    assert [t["text"] for t in regen[:2]] == [t["text"] for t in first[:2]] and len(regen) > 2
    d.save_screenshot(str(shots / "6-regenerated.png"))

    # Phone width: nothing overflows sideways.
    d.set_window_size(390, 844)
    width = js(d, "return [document.documentElement.scrollWidth, window.innerWidth]")
    assert width[0] <= width[1] + 1
    d.save_screenshot(str(shots / "7-phone.png"))
    assert all((shots / f).stat().st_size > 1000 for f in os.listdir(shots))


def test_completion_mode_and_a_bad_field_shows_the_error(served, browser):
    from selenium.webdriver.common.by import By

    d = browser
    d.set_window_size(1280, 1000)
    open_page(d, served)
    d.find_element(By.CSS_SELECTOR, "input[name=mode][value=completion]").click()
    set_value(d, "logit_bias", '{"not-an-id": 5}')
    d.find_element(By.ID, "generate").click()
    wait(d, lambda dr: dr.find_element(By.ID, "error").text != "", what="the error")
    assert "logit_bias" in d.find_element(By.ID, "error").text
    set_value(d, "logit_bias", "")
    toks = generate(d, seed=3, max_tokens=6)
    assert toks and all(t["p"] is not None for t in toks)


def test_no_playground_turns_the_page_off():
    from tests.helpers import background_server
    from tests.unit.fake_engine import FakeEngine

    with background_server(FakeEngine(), playground=False) as off, background_server(FakeEngine()) as on:
        assert httpx.get(off.url + "/").status_code == 404
        assert httpx.get(off.url + "/playground/static/playground.js").status_code == 404
        assert httpx.get(on.url + "/").status_code == 200  # no --api-key: open
        assert "/" not in httpx.get(on.url + "/openapi.json").json()["paths"]


def test_logprobs_mode_per_request(served):
    """The field the page relies on: processed logprobs are the sampler's distribution (top-k 2 leaves two tokens
    whose probabilities sum to 1), raw ones the model's (the same request, raw: more than two, summing below 1)."""
    import math

    auth = {"Authorization": f"Bearer {KEY}"}
    model = httpx.get(served + "/v1/models", headers=auth).json()["data"][0]["id"]

    def tops(mode: str) -> list[dict[str, float]]:
        body = {"model": model, "prompt": "The capital of France is", "max_tokens": 3, "logprobs": 5, "top_k": 2,
                "seed": 1, "logprobs_mode": mode}
        r = httpx.post(served + "/v1/completions", json=body, headers=auth, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["top_logprobs"]

    for pos in tops("processed_logprobs"):
        probs = [p for p in (math.exp(v) for v in pos.values()) if p > 0]  # cut tokens: -inf (sent finite)
        assert len(probs) <= 2 and abs(sum(probs) - 1) < 1e-3
    for pos in tops("raw_logprobs"):
        assert len(pos) >= 3 and sum(math.exp(v) for v in pos.values()) < 1
    bad = httpx.post(served + "/v1/completions", headers=auth, json={"model": model, "prompt": "x",
                                                                     "logprobs_mode": "sometimes"})
    assert bad.status_code == 400 and "logprobs_mode" in bad.text


def test_more_knobs_reshape_the_chart_and_reach_the_server(served, browser):
    """The "more knobs" controls: typical-p / epsilon / eta / XTC redraw the chart exactly as transformers' warpers
    (and llama.cpp's XTC rule) cut the chart's 20 probabilities, and a generation with DRY, mirostat and the
    warpers goes through (the server accepts every field the page sends)."""
    import math

    import torch
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from transformers.generation.logits_process import EpsilonLogitsWarper, TypicalLogitsWarper

    d = browser
    d.set_window_size(1280, 1000)
    open_page(d, served)
    toks = generate(d, seed=5, max_tokens=8)
    assert toks
    ActionChains(d).move_to_element(d.find_elements(By.CSS_SELECTOR, "#output .tok")[1]).perform()
    wait(d, lambda dr: len(dr.find_elements(By.CSS_SELECTOR, "#chart .bar-row")) >= 5, what="the chart")
    d.find_element(By.CSS_SELECTOR, "#more-knobs summary").click()

    def chart():
        return js(d, "return [...document.querySelectorAll('#chart .bar-row')].map(r => "
                     "[Number(r.dataset.raw), r.classList.contains('cut'), r.querySelector('.num').textContent])")

    raw = torch.tensor([r[0] for r in chart()], dtype=torch.float64)
    scores = (raw / raw.sum()).log().unsqueeze(0)
    ids = torch.zeros(1, 1, dtype=torch.long)
    for knob, value, warper in (("typical_p", "0.5", TypicalLogitsWarper(0.5)),
                                ("epsilon_cutoff", "0.03", EpsilonLogitsWarper(0.03))):
        set_value(d, knob, value)
        want = torch.isinf(warper(ids, scores.clone())[0]).tolist()
        assert [r[1] for r in chart()] == want and any(want)
        set_value(d, knob, "1" if knob == "typical_p" else "0")
    set_value(d, "xtc_probability", "0.5")
    set_value(d, "xtc_threshold", "0.05")
    p = (raw / raw.sum()).tolist()
    above = [i for i, x in enumerate(p) if x >= 0.05]
    rows = chart()
    if len(above) >= 2:
        least = min(p[i] for i in above)
        assert [r[1] for r in rows] == [i in above and p[i] > least for i in range(len(p))]
        assert any("xtc" in r[2] for r in rows)
    set_value(d, "xtc_probability", "0")
    assert not any(r[1] for r in chart()) and math.isclose(sum(r[0] for r in chart()), raw.sum().item(), rel_tol=1e-3)

    for knob, value in (("dry_multiplier", "0.8"), ("no_repeat_ngram_size", "3"), ("typical_p", "0.9"),
                        ("top_n_sigma", "2"), ("dynatemp_range", "0.5")):
        set_value(d, knob, value)
    assert generate(d, seed=3, max_tokens=6)
    set_value(d, "mirostat", "2")  # with typical-p still on: the server's 400 says why, on the page
    d.find_element(By.ID, "generate").click()
    wait(d, lambda dr: "mirostat" in dr.find_element(By.ID, "error").text, what="the mirostat error")
    for knob, value in (("typical_p", "1"), ("top_n_sigma", "0"), ("dynatemp_range", "0")):
        set_value(d, knob, value)
    assert generate(d, seed=3, max_tokens=6)  # mirostat 2 with DRY and no-repeat n-grams
