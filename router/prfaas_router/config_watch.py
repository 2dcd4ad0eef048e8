"""Hot reload of the router config written by the operator: the mounted file, and the API.

The file is polled (stat, then content) about once a second: a ConfigMap volume swaps its files
behind a symlink, which inotify on the path would miss. A file that fails validation is refused
and the last good config stays; so is one with an older `version`, and one that reuses the
version in force with other content (the operator bumps the version on every change, so that is
a second writer or a mistake; applying it would make the version a lie). The router says so in its
log, in `/config` (`last_error`) and in a counter. In-flight requests keep the config snapshot
they started with, so a reload drops nothing. ``offer`` is the one way in, also for the
ConfigMap watch (configmap_source.py), which sees a change long before the kubelet's copy.

The file is read in a worker thread, and only a regular file of at most `MAX_CONFIG_BYTES`: a
FIFO or a device at the path would block the event loop, a huge file would hold it. Whatever
goes wrong with a document, applying it included, is a refusal in `last_error`, never an
exception that ends the loop (the router would stop on every start).
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

from prfaas_core.router_config import RouterConfig
from prfaas_core.routing.policy import ConfigRefused, PolicyModel
from pydantic import ValidationError

from prfaas_router.metrics import RouterMetrics

log = logging.getLogger("prfaas_router.config")

Apply = Callable[[RouterConfig, PolicyModel], None]
MAX_CONFIG_BYTES = 4 * 1024 * 1024
"""Far above any config the operator writes (the pools are capped, MAX_ENDPOINTS_PER_POOL)."""


class _Unreadable(Exception):
    """The path holds no config file the router will read."""


def _read_config(path: Path, seen: tuple[int, int, int] | None) -> tuple[tuple[int, int, int], bytes | None]:
    """The file's signature and, when it changed, its content (in a worker thread: may block)."""
    found = os.stat(path)
    signature = (found.st_mtime_ns, found.st_size, found.st_ino)
    if signature == seen:
        return signature, None
    if not stat.S_ISREG(found.st_mode):
        raise _Unreadable("not a regular file")
    if found.st_size > MAX_CONFIG_BYTES:
        raise _Unreadable(f"{found.st_size} bytes, over the {MAX_CONFIG_BYTES}-byte limit")
    with path.open("rb") as file:
        content = file.read(MAX_CONFIG_BYTES + 1)
    if len(content) > MAX_CONFIG_BYTES:
        raise _Unreadable(f"over the {MAX_CONFIG_BYTES}-byte limit")
    return signature, content


class ConfigWatcher:
    def __init__(self, path: Path, apply: Apply, metrics: RouterMetrics, poll_seconds: float) -> None:
        self.path = path
        self._apply = apply
        self._metrics = metrics
        self._poll_seconds = poll_seconds
        self._seen: tuple[int, int, int] | None = None
        self._content: bytes | None = None
        self.current: RouterConfig | None = None
        self.source: str | None = None
        """Where the config in force came from: the file's path, or ``configmap NS/NAME``."""
        self.api_source = False
        """Set when a ConfigMapSource also offers configs (the file then lags behind it)."""
        self.loaded_at: float | None = None  # wall clock, for people reading /config
        self.last_error: str | None = None

    async def check(self) -> bool:
        """Read the file if it changed (off the event loop); True when a new config was applied."""
        try:
            signature, content = await asyncio.to_thread(_read_config, self.path, self._seen)
        except (OSError, _Unreadable) as err:
            why = err.strerror or str(err) if isinstance(err, OSError) else str(err)
            self._refuse(f"cannot read {self.path}: {why}", content=None, origin=str(self.path))
            return False
        if content is None:
            return False
        self._seen = signature
        # With an API source the kubelet's copy lags behind: an older file is expected, not an error.
        return self.offer(content, str(self.path), older_is_stale=self.api_source)

    def offer(self, content: bytes, origin: str, *, older_is_stale: bool = False) -> bool:
        """Validate and apply a config document from ``origin``; True when it was applied."""
        if content == self._content:
            return False
        try:
            config = RouterConfig.from_json(content)
            model = PolicyModel.from_config(config)
        except ValidationError as err:
            self._refuse(_summary(err), content, origin)
            return False
        except (ConfigRefused, ValueError) as err:
            self._refuse(str(err), content, origin)
            return False
        current = self.current
        if current is not None and config.version <= current.version:
            if config.version < current.version and not older_is_stale:
                self._refuse(
                    f"version {config.version} is older than the current {current.version}", content, origin
                )
            elif config.version == current.version and config != current:
                self._refuse(
                    f"version {config.version} is already in force with different content "
                    "(a changed config needs a new version)",
                    content,
                    origin,
                )
            return False
        self._content = content
        try:
            self._apply(config, model)
        except Exception as err:  # a config validation let through: refused, the router keeps serving
            log.exception("applying config version %d failed", config.version)
            self._refuse(f"cannot apply: {err.__class__.__name__}", content, origin)
            return False
        self.current = config
        self.source = origin
        self.loaded_at = time.time()
        self.last_error = None
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._poll_seconds)
            try:
                await self.check()
            except Exception:  # a bug must not stop reloading
                log.exception("config reload failed")

    def _refuse(self, why: str, content: bytes | None, origin: str) -> None:
        if content is None:  # unreadable: look again next poll, but say it once
            self._seen = None
            if self.last_error and self.last_error.endswith(why):
                return
        else:
            self._content = content  # the same refused document is not refused again
        kept = f"keeping version {self.current.version}" if self.current else "no config loaded yet"
        self.last_error = f"config {origin} refused ({kept}): {why}"
        self._metrics.config_errors.inc()
        log.warning("%s", self.last_error)


def _summary(err: ValidationError) -> str:
    parts = []
    for item in err.errors()[:5]:
        where = ".".join(str(part) for part in item["loc"]) or "document"
        parts.append(f"{where}: {item['msg']}")
    more = err.error_count() - len(parts)
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")
