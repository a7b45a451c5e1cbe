"""JupyterLab driven by Debian's Chromium through Selenium, for tests that assert in the page's DOM.

``Lab`` starts a real JupyterLab server (token, 127.0.0.1, a free port, a
temporary root directory) and a headless Chromium with the matching
chromium-driver, both from the system (never a downloaded browser build).
Notebooks are written to the root directory and opened in the page; cells run
through the page (click, Shift+Enter), and what the tests read comes from the
DOM: plot elements' ``data``, cell text, output areas.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


def missing() -> str | None:
    """Why browser tests cannot run here (None when they can)."""
    if not CHROMIUM or not os.path.exists(DRIVER):
        return "Debian's chromium and chromium-driver are needed (.ci/setup installs them as root with apt)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is needed (pip install -e '.[test]')"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def notebook(*sources: str) -> dict:
    cells = [{"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {}, "outputs": [],
              "source": src} for i, src in enumerate(sources)]
    return {"cells": cells, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                        "language": "python"}},
            "nbformat": 4, "nbformat_minor": 5}


class Lab:
    """A JupyterLab server plus one Chromium page; ``close()`` stops both."""

    def __init__(self, root: Path, artifacts: Path, width: int = 1280, height: int = 1000):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        self.root, self.artifacts = Path(root), Path(artifacts)
        self.artifacts.mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_hex(16)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, JUPYTER_CONFIG_DIR=str(self.root / ".jupyter-config"))
        # keep the user's settings out: default JupyterLab settings, like a new user
        env["JUPYTERLAB_SETTINGS_DIR"] = str(self.root / ".lab-settings")
        env["JUPYTERLAB_WORKSPACES_DIR"] = str(self.root / ".lab-workspaces")
        news = self.root / ".lab-settings" / "@jupyterlab" / "apputils-extension"
        news.mkdir(parents=True, exist_ok=True)  # no "get notified about news?" toast over the cells
        (news / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
        # no autosave: the tests save when they mean to. An autosave in flight while a test's save starts
        # made JupyterLab ask "File Changed: overwrite?", and a save marks the page clean even where an
        # output changed while it was in flight (plotly's renderer storing its PNG), so that change was
        # never written (CI saved 3 of 5 PNGs)
        docs = self.root / ".lab-settings" / "@jupyterlab" / "docmanager-extension"
        docs.mkdir(parents=True, exist_ok=True)
        (docs / "plugin.jupyterlab-settings").write_text('{"autosave": false}')
        self.server_log = open(self.artifacts / "jupyterlab.log", "w")
        self.server = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
             f"--ServerApp.token={self.token}", f"--ServerApp.root_dir={self.root}",
             "--ServerApp.open_browser=False", "--LabApp.news_url=", "--LabApp.check_for_updates_class="
             "jupyterlab.NeverCheckForUpdate", "--ServerApp.allow_root=True"],
            stdout=self.server_log, stderr=subprocess.STDOUT, env=env, cwd=self.root)
        self.driver = None
        try:
            self._wait_server()
            opts = webdriver.ChromeOptions()
            opts.binary_location = CHROMIUM
            for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--no-first-run", "--disable-background-networking", "--disable-component-update",
                         "--disable-sync", f"--window-size={width},{height}",
                         # resolve no host but loopback: exported pages name CDNs; nothing may leave the machine
                         "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"):
                opts.add_argument(flag)
            opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
            self.driver = webdriver.Chrome(options=opts, service=Service(DRIVER))
            self.driver.set_script_timeout(30)
            # keep the reasons of unhandled promise rejections (the console only says "Uncaught (in promise)")
            self.driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": (
                "window.__rejections = []; window.addEventListener('unhandledrejection', e => "
                "window.__rejections.push(String((e.reason && (e.reason.stack || e.reason.message)) || e.reason)));")})
        except BaseException:
            self.close()
            raise

    def _wait_server(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                raise RuntimeError(f"JupyterLab exited: {(self.artifacts / 'jupyterlab.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/status?token={self.token}", timeout=2):
                    return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError("JupyterLab did not answer within 60 s")

    # -- files and the server's REST API ------------------------------------------
    def write(self, name: str, nb: dict) -> None:
        (self.root / name).write_text(json.dumps(nb))

    def api(self, path: str, method: str = "GET", body: dict | None = None):
        req = urllib.request.Request(f"{self.url}/api/{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"token {self.token}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            data = r.read()
        return json.loads(data) if data else None

    def saved(self, name: str) -> dict:
        return json.loads((self.root / name).read_text())

    # -- the page -----------------------------------------------------------------
    def open(self, name: str, timeout: float = 90.0) -> None:
        # a workspace of its own: only this notebook open, whatever earlier tests opened
        ws = "".join(ch for ch in name if ch.isalnum())
        self.driver.get(f"{self.url}/lab/workspaces/{ws}/tree/{name}?token={self.token}")
        self.wait(lambda: self.cells() and self.cells()[0].find_element("css selector", ".cm-content").is_displayed(),
                  timeout, f"notebook {name} did not open")
        # the status bar says "Python 3 (ipykernel) | Idle" once the kernel is up
        self.wait(lambda: "| Idle" in self.js("return document.querySelector('#jp-main-statusbar').innerText"),
                  timeout, "the kernel did not become idle")

    def open_notebook7(self, name: str, timeout: float = 90.0) -> None:
        """Open ``name`` in Notebook 7's own page (served by the same server), kernel idle."""
        self.driver.get(f"{self.url}/notebooks/{name}?token={self.token}")
        self.wait(lambda: self.cells() and self.cells()[0].find_element("css selector", ".cm-content").is_displayed(),
                  timeout, f"notebook {name} did not open in Notebook 7")
        self.wait(lambda: any(s["kernel"]["execution_state"] == "idle" for s in self.api("sessions")
                              if s.get("path") == name), timeout, "the kernel did not become idle")

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def wait(self, cond, timeout: float, what: str, every: float = 0.2):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            try:
                last = cond()
            except Exception as e:  # the page is still changing: try again
                last = e
            if last and not isinstance(last, Exception):
                return last
            time.sleep(every)
        self.screenshot(what)
        raise AssertionError(f"{what} (within {timeout:g} s; last: {last!r})")

    def cells(self):
        return self.driver.find_elements("css selector", ".jp-Notebook .jp-Cell")

    def cell_text(self, i: int) -> str:
        return self.js("const c = document.querySelectorAll('.jp-Notebook .jp-Cell')[arguments[0]];"
                       "return c.querySelector('.cm-content').innerText", i).replace("\xa0", " ")

    def output_text(self, i: int) -> str:
        return self.js("const c = document.querySelectorAll('.jp-Notebook .jp-Cell')[arguments[0]];"
                       "const o = c.querySelector('.jp-OutputArea'); return o ? o.innerText : ''", i)

    def select(self, i: int) -> None:
        """Make cell i the active cell in command mode (click its prompt area)."""
        from selenium.webdriver.common.keys import Keys

        cell = self.cells()[i]
        self.js("arguments[0].scrollIntoView({block: 'center'})", cell)
        editor = cell.find_element("css selector", ".cm-content")
        self.wait(lambda: editor.is_displayed() and editor.is_enabled(), 10, f"cell {i} cannot be clicked")
        editor.click()
        editor.send_keys(Keys.ESCAPE)

    def run(self, i: int) -> None:
        """Run cell i as a user does: select it, Shift+Enter (again if the page did not take the keys)."""
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.keys import Keys

        before = self.prompt(i)
        for _ in range(3):
            self.select(i)
            ActionChains(self.driver).key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT).perform()
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                if self.prompt(i) != before:  # "[*]:" at once when queued, or a new count
                    return
                time.sleep(0.1)
        raise AssertionError(f"cell {i} did not start: its prompt stayed {before!r}")

    def prompt(self, i: int) -> str:
        """Cell i's input prompt: "[ ]:", "[*]:" while it runs, "[7]:" once done."""
        return self.js("return document.querySelectorAll('.jp-Notebook .jp-Cell')[arguments[0]]"
                       ".querySelector('.jp-InputPrompt').innerText", i).strip()

    def run_and_wait(self, i: int, timeout: float) -> None:
        """Run cell i and wait until it has finished (its prompt shows a new execution count)."""
        before = self.prompt(i)
        self.run(i)
        self.wait(lambda: self.prompt(i) not in (before, "[*]:") and "*" not in self.prompt(i), timeout,
                  f"cell {i} did not finish")

    def busy(self) -> bool:
        return "*" in self.js("return Array.from(document.querySelectorAll('.jp-InputPrompt'))"
                              ".map(e => e.innerText).join(' ')")

    def wait_idle(self, timeout: float) -> None:
        self.wait(lambda: not self.busy(), timeout, "cells still running", every=0.5)

    def plots(self, i: int | None = None) -> list[list[int]]:
        """For each plotly plot (in cell i, or the page): the number of points of each trace, from the DOM."""
        return self.js("""
            const root = arguments[0] === null ? document
                : document.querySelectorAll('.jp-Notebook .jp-Cell')[arguments[0]];
            return Array.from(root.querySelectorAll('.js-plotly-plot')).map(p =>
                (p.data || []).map(t => Math.max((t.x || []).length, (t.y || []).length)));""", i)

    def plot_y(self, i: int) -> list[list]:
        """The y values of each trace of the first plot in cell i, from the DOM."""
        return self.js("""
            const p = document.querySelectorAll('.jp-Notebook .jp-Cell')[arguments[0]].querySelector('.js-plotly-plot');
            return (p.data || []).map(t => Array.from(t.y || []));""", i)

    def _dropdown(self, i: int, label: str):
        for box in self.cells()[i].find_elements("css selector", ".widget-dropdown"):
            if box.find_element("css selector", "label").get_attribute("textContent").strip() == label:
                return box.find_element("css selector", "select")
        raise AssertionError(f"no dropdown labelled {label!r} in cell {i}")

    def selected(self, i: int, label: str) -> str:
        """The text shown by the dropdown labelled ``label`` in cell i's output."""
        return self.js("return arguments[0].options[arguments[0].selectedIndex].text",
                       self._dropdown(i, label)).replace("\xa0", " ")

    def set_select(self, i: int, label: str, text: str) -> None:
        """Choose ``text`` in the dropdown labelled ``label`` in cell i's output, as a user does."""
        from selenium.webdriver.support.ui import Select

        Select(self._dropdown(i, label)).select_by_visible_text(text)

    def console_errors(self) -> list[str]:
        """Severe console messages, with the reasons of unhandled promise rejections."""
        errors = [e["message"] for e in self.driver.get_log("browser") if e["level"] == "SEVERE"]
        return errors + [f"rejection: {r}" for r in self.js("return window.__rejections || []")]

    def save(self, name: str | None = None, timeout: float = 30.0) -> None:
        """Ctrl+S, as a user saves; with ``name``, wait until the server has written that file anew
        and the page is clean (a save happens even where the page was clean already)."""
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.keys import Keys

        before = (self.root / name).stat().st_mtime_ns if name else None
        ActionChains(self.driver).key_down(Keys.CONTROL).send_keys("s").key_up(Keys.CONTROL).perform()
        if name:
            self.wait(lambda: (self.root / name).stat().st_mtime_ns != before
                      and not self.js("return document.querySelector('.jp-mod-dirty') !== null"),
                      timeout, f"{name} was not saved")

    def screenshot(self, what: str) -> None:
        if self.driver is None:
            return
        name = "".join(ch if ch.isalnum() else "_" for ch in what)[:60]
        try:
            self.driver.save_screenshot(str(self.artifacts / f"{name}.png"))
        except Exception:
            pass

    def shot_output(self, i: int, name: str) -> None:
        """A picture of cell i's output area (kept with the test log, to look at what users see)."""
        try:
            out = self.cells()[i].find_element("css selector", ".jp-Cell-outputWrapper")
            self.js("arguments[0].scrollIntoView({block: 'start'})", out)
            out.screenshot(str(self.artifacts / f"{name}.png"))
        except Exception:
            pass

    def shot_element(self, i: int, selector: str, name: str) -> None:
        """A picture of the first element matching ``selector`` in cell i's output."""
        try:
            el = self.cells()[i].find_element("css selector", selector)
            self.js("arguments[0].scrollIntoView({block: 'start'})", el)
            el.screenshot(str(self.artifacts / f"{name}.png"))
        except Exception:
            pass

    def close(self) -> None:
        if self.driver is not None:
            try:
                self.driver.quit()
            except Exception:
                pass
            self.driver = None
        if self.server.poll() is None:
            self.server.terminate()
            try:
                self.server.wait(15)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait(5)
        self.server_log.close()
