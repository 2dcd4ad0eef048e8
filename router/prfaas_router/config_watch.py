"""Hot reload of the router config file written by the operator.

The file is polled (stat, then content) about once a second: a ConfigMap volume swaps its files
behind a symlink, which inotify on the path would miss. A file that fails validation is refused
and the last good config stays; so is one with an older `version`. The router says so in its
log, in `/config` (`last_error`) and in a counter. In-flight requests keep the config snapshot
they started with, so a reload drops nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from prfaas_core.router_config import RouterConfig
from pydantic import ValidationError

from prfaas_router.metrics import RouterMetrics
from prfaas_router.policy import ConfigRefused, PolicyModel

log = logging.getLogger("prfaas_router.config")

Apply = Callable[[RouterConfig, PolicyModel], None]


class ConfigWatcher:
    def __init__(self, path: Path, apply: Apply, metrics: RouterMetrics, poll_seconds: float) -> None:
        self.path = path
        self._apply = apply
        self._metrics = metrics
        self._poll_seconds = poll_seconds
        self._seen: tuple[int, int, int] | None = None
        self._content: bytes | None = None
        self.current: RouterConfig | None = None
        self.loaded_at: float | None = None  # wall clock, for people reading /config
        self.last_error: str | None = None

    def check(self) -> bool:
        """Read the file if it changed; True when a new config was applied."""
        try:
            stat = os.stat(self.path)
            signature = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
            if signature == self._seen:
                return False
            content = self.path.read_bytes()
        except OSError as err:
            self._refuse(f"cannot read {self.path}: {err.strerror or err}", content=None)
            return False
        self._seen = signature
        if content == self._content:
            return False
        self._content = content
        try:
            config = RouterConfig.from_json(content)
            model = PolicyModel.from_config(config)
        except ValidationError as err:
            self._refuse(_summary(err), content)
            return False
        except (ConfigRefused, ValueError) as err:
            self._refuse(str(err), content)
            return False
        if self.current is not None and config.version < self.current.version:
            self._refuse(
                f"version {config.version} is older than the current {self.current.version}", content
            )
            return False
        self._apply(config, model)
        self.current = config
        self.loaded_at = time.time()
        self.last_error = None
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._poll_seconds)
            try:
                self.check()
            except Exception:  # a bug in applying must not stop reloading
                log.exception("config reload failed")

    def _refuse(self, why: str, content: bytes | None) -> None:
        if content is None:  # unreadable: look again next poll, but say it once
            self._seen = None
            if self.last_error and self.last_error.endswith(why):
                return
        kept = f"keeping version {self.current.version}" if self.current else "no config loaded yet"
        self.last_error = f"config {self.path} refused ({kept}): {why}"
        self._metrics.config_errors.inc()
        log.warning("%s", self.last_error)


def _summary(err: ValidationError) -> str:
    parts = []
    for item in err.errors()[:5]:
        where = ".".join(str(part) for part in item["loc"]) or "document"
        parts.append(f"{where}: {item['msg']}")
    more = err.error_count() - len(parts)
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")
