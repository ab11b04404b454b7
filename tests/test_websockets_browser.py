"""MQTT over WebSockets from a real browser: headless Chromium (Debian's ``chromium``) loads a small static
page served on 127.0.0.1 that connects to the broker's ``protocol = "websockets"`` listener with mqtt.js (installed
from npm by this test into its temp dir, never into the repository; its browser bundle ``dist/mqtt.min.js``) and
exchanges QoS 1 messages with a Python client (paho-mqtt over TCP):

1. the page subscribes (QoS 1) and publishes "hello from chromium" (QoS 1);
2. the Python client receives it and answers with a QoS 1 message of its own;
3. the page shows the text it received (a green box) and reports its DOM text back over MQTT (QoS 1);
4. the Python client checks the report; only then does the page's last resource (an image the test's HTTP server
   holds back) arrive, the load event fires and Chromium takes the screenshot, which must show the green box
   (its pixels are counted) and is kept as build/screenshots/websockets-browser.png for a human to look at.

Skipped, with the reason, when chromium or npm is not installed or the npm registry is not reachable.
"""

from __future__ import annotations

import http.server
import shutil
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from helpers import ROOT, BrokerProcess
from paho.mqtt.enums import CallbackAPIVersion

SCREENSHOT = ROOT / "build" / "screenshots" / "websockets-browser.png"
GREEN = (0, 158, 115)  # Okabe-Ito bluish green: the box the page turns when the message arrived
CONFIG = """
[store]
backend = "memory"
[listeners.tcp]
bind = "127.0.0.1:0"
[listeners.ws]
bind = "127.0.0.1:0"
protocol = "websockets"
"""

PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>edge-gateway over WebSockets</title>
<style>
body {{ font: 28px sans-serif; margin: 24px; }}
#received {{ padding: 24px; min-height: 80px; border: 4px solid #999; }}
#received.ok {{ background: rgb{green}; color: white; border-color: rgb{green}; }}
</style>
<script src="mqtt.min.js"></script></head>
<body>
<h1>mqtt.js in Chromium</h1>
<div id="state">connecting</div>
<div id="received">nothing yet</div>
<img id="hold" width="1" height="1">
<script>
const base = "{base}";
const state = document.getElementById("state");
const box = document.getElementById("received");
document.getElementById("hold").src = "/hold.gif";  // the load event (and the screenshot) waits for it
const client = mqtt.connect("ws://127.0.0.1:{port}/mqtt", {{clientId: "chromium-{uid}", protocolVersion: 5}});
client.on("error", (e) => {{ state.textContent = "error: " + e.message; }});
client.on("connect", () => {{
  state.textContent = "connected";
  client.subscribe(base + "/to-browser", {{qos: 1}}, (err) => {{
    if (err) {{ state.textContent = "subscribe failed: " + err; return; }}
    client.publish(base + "/from-browser", "hello from chromium", {{qos: 1}});
  }});
}});
client.on("message", (topic, payload) => {{
  box.textContent = payload.toString();
  box.className = "ok";
  state.textContent = "received";
  client.publish(base + "/report", box.textContent, {{qos: 1}});
}});
</script></body></html>
"""


def _tool(name: str) -> str:
    exe = shutil.which(name)
    if exe is None:
        pytest.skip(f"{name} is not installed (make deps installs chromium; npm comes with Debian's npm package)")
    return exe


@pytest.fixture(scope="module")
def mqtt_js(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """mqtt.js's browser bundle, installed from npm into a temp dir (its cache too)."""
    npm = _tool("npm")
    where = tmp_path_factory.mktemp("npm")
    try:
        proc = subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--no-save", "--no-package-lock", "--cache",
             str(where / "cache"), "--prefix", str(where), "mqtt@5"],
            capture_output=True, text=True, timeout=180, cwd=where,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.skip("npm install mqtt did not finish within 180 s (is the npm registry reachable?)")
    bundle = where / "node_modules" / "mqtt" / "dist" / "mqtt.min.js"
    if proc.returncode != 0 or not bundle.is_file():
        pytest.skip(f"npm install mqtt failed (npm registry not reachable?): {proc.stderr.strip()[-500:]}")
    return bundle


class StaticSite:
    """The page and mqtt.js on 127.0.0.1 (an ephemeral port); ``/hold.gif`` is answered once ``release`` is set
    (or after 60 s)."""

    GIF = b"GIF89a\x01\x00\x01\x00\x80\x00\x00\x00\x00\x00\xff\xff\xff!\xf9\x04\x01\x00\x00\x00\x00,\x00\x00\x00\x00\x01\x00\x01\x00\x00\x02\x02D\x01\x00;"  # noqa: E501

    def __init__(self, directory: Path) -> None:
        self.release = threading.Event()
        site = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, directory=str(directory), **kwargs)

            def do_GET(self) -> None:
                if self.path == "/hold.gif":
                    site.release.wait(60)
                    self.send_response(200)
                    self.send_header("Content-Type", "image/gif")
                    self.send_header("Content-Length", str(len(site.GIF)))
                    self.end_headers()
                    self.wfile.write(site.GIF)
                    return
                super().do_GET()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def ws_broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    (tmp_path / "broker").mkdir()
    proc = BrokerProcess(CONFIG, workdir=str(tmp_path / "broker")).start()
    yield proc
    assert proc.stop() == 0, proc.log()


def green_pixels(png: Path) -> int:
    image_module = pytest.importorskip("PIL.Image")
    with image_module.open(png) as image:
        data = image.convert("RGB").tobytes()
    return sum(
        1
        for i in range(0, len(data), 3)
        if abs(data[i] - GREEN[0]) <= 8 and abs(data[i + 1] - GREEN[1]) <= 8 and abs(data[i + 2] - GREEN[2]) <= 8
    )


def test_chromium_with_mqtt_js_exchanges_qos1_messages_with_a_python_client(
    ws_broker: BrokerProcess, mqtt_js: Path, tmp_path: Path
) -> None:
    chromium = _tool("chromium")
    uid = uuid.uuid4().hex[:10]
    base = f"browser/{uid}"
    answer = f"hello browser, from python {uid}"
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    shutil.copy(mqtt_js, site_dir / "mqtt.min.js")
    (site_dir / "index.html").write_text(PAGE.format(base=base, port=ws_broker.ports["ws"], uid=uid, green=GREEN))
    site = StaticSite(site_dir)

    got: dict[str, list[bytes]] = {"from-browser": [], "report": []}
    subscribed = threading.Event()
    python = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"python-{uid}", protocol=mqtt.MQTTv5)

    def on_message(client: mqtt.Client, _userdata: Any, msg: mqtt.MQTTMessage) -> None:
        kind = msg.topic.rsplit("/", 1)[1]
        got[kind].append(msg.payload)
        if kind == "from-browser" and msg.qos == 1:
            client.publish(base + "/to-browser", answer, qos=1)
        elif kind == "report" and msg.payload == answer.encode():
            site.release.set()  # the exchange is complete: let the page finish loading (screenshot)

    python.on_connect = lambda c, *a: c.subscribe([(base + "/from-browser", 1), (base + "/report", 1)])
    python.on_subscribe = lambda *a: subscribed.set()
    python.on_message = on_message
    python.connect("127.0.0.1", ws_broker.ports["tcp"], keepalive=30)
    python.loop_start()
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    png = tmp_path / "page.png"
    try:
        assert subscribed.wait(10), ws_broker.log()
        proc = subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--hide-scrollbars", f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1000,600",
             f"--screenshot={png}", f"http://127.0.0.1:{site.port}/index.html"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        python.disconnect()
        python.loop_stop()
        site.close()
    assert proc.returncode == 0 and png.is_file(), proc.stderr[-2000:]
    shutil.copy(png, SCREENSHOT)
    # the broker carried both QoS 1 messages, and the page showed what it received
    assert got["from-browser"] == [b"hello from chromium"], (got, ws_broker.log())
    assert got["report"] == [answer.encode()], (got, ws_broker.log())
    assert green_pixels(png) > 20_000, f"no green box in the screenshot ({SCREENSHOT})"
