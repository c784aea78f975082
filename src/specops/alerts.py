"""Alerts: run a command and/or POST JSON to a URL when something a human must know happens.

Events: `stall`, `runner_dead`, `server_down`, `server_up`, `finished`, `failed`. Each alert is a
JSON payload `{"event", "campaign", "at", "message", ...}`; the command gets it on stdin and as
`$SPECOPS_ALERT_EVENT` / `$SPECOPS_ALERT_MESSAGE`. An alert never raises: a broken hook is logged,
and the campaign goes on. The same event is not sent again within `repeat_s` (default 15 min).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
import urllib.request
from typing import Any

from .campaign import now_iso

log = logging.getLogger("specops.alerts")

EVENTS = ("stall", "runner_dead", "server_down", "server_up", "finished", "failed")


class Alerter:
    def __init__(self, *, command: str | None, url: str | None, events: list[str], campaign: str,
                 repeat_s: float = 900.0, timeout_s: float = 10.0):
        self.command = command
        self.url = url
        self.events = set(events)
        self.campaign = campaign
        self.repeat_s = repeat_s
        self.timeout_s = timeout_s
        self._last: dict[str, float] = {}
        self.sent: list[dict[str, Any]] = []
        self._threads: list[threading.Thread] = []

    @classmethod
    def from_config(cls, cfg, campaign: str) -> "Alerter":
        m = cfg.monitor
        return cls(command=m.alert_command, url=m.alert_url, events=list(m.alert_events), campaign=campaign,
                   repeat_s=m.alert_repeat_s)

    @property
    def enabled(self) -> bool:
        return bool(self.command or self.url)

    def fire(self, event: str, message: str, **fields: Any) -> bool:
        assert event in EVENTS, event
        if not self.enabled or event not in self.events:
            return False
        now = time.monotonic()
        if event in self._last and now - self._last[event] < self.repeat_s:
            return False
        self._last[event] = now
        payload = {"event": event, "campaign": self.campaign, "at": now_iso(), "message": message, **fields}
        data = json.dumps(payload).encode()
        self.sent.append(payload)
        log.warning("alert %s: %s", event, message)
        # Hooks run on a thread: a slow hook must never freeze the runner's event loop.
        t = threading.Thread(target=self._deliver, args=(event, message, data), name="specops-alert", daemon=True)
        t.start()
        self._threads.append(t)
        return True

    def wait(self, timeout: float = 15.0) -> None:
        """Wait for alerts in delivery (at the end of a run, so a final alert is not cut off)."""
        for t in self._threads:
            t.join(timeout)
        self._threads = [t for t in self._threads if t.is_alive()]

    def _deliver(self, event: str, message: str, data: bytes) -> None:
        if self.command:
            try:
                subprocess.run(
                    self.command, shell=True, input=data, timeout=self.timeout_s, check=False,
                    env={**os.environ, "SPECOPS_ALERT_EVENT": event, "SPECOPS_ALERT_MESSAGE": message},
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )
            except (OSError, subprocess.SubprocessError) as e:
                log.error("alert command failed: %s", e)
        if self.url:
            req = urllib.request.Request(self.url, data=data, headers={"Content-Type": "application/json"})
            try:
                urllib.request.urlopen(req, timeout=self.timeout_s).close()
            except OSError as e:
                log.error("alert POST to %s failed: %s", self.url, e)
