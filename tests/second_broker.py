"""A second, independently written MQTT broker for the suite: amqtt (asyncio, MQTT 3.1.1), run as
its own process on a free loopback port, so "any MQTT broker" is tested against more than
mosquitto."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from fedfleet.emulation.broker import free_port, wait_until_listening
from fedfleet.emulation.processes import stop_all

CONFIG = """listeners:
  default:
    type: tcp
    bind: 127.0.0.1:{port}
plugins:
  amqtt.plugins.authentication.AnonymousAuthPlugin:
    allow_anonymous: true
"""


class AmqttBroker:
    def __init__(self):
        self.port = free_port()
        self._tmp = tempfile.TemporaryDirectory(prefix="fedfleet-amqtt-")
        self.conf = Path(self._tmp.name) / "amqtt.yaml"
        self.conf.write_text(CONFIG.format(port=self.port))
        self.proc = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}?version=3.1.1"

    def __enter__(self) -> "AmqttBroker":
        amqtt = Path(sys.executable).with_name("amqtt")
        self.log = open(Path(self._tmp.name) / "amqtt.log", "wb")
        self.proc = subprocess.Popen([str(amqtt), "-c", str(self.conf)], stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_until_listening(self.proc, self.port, Path(self._tmp.name) / "amqtt.log", 20)
        except TimeoutError:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        if self.proc:
            stop_all([self.proc], first_is_done=False, grace_s=5)
        self._tmp.cleanup()
