"""Periodic health checks (GET /health) of every worker, feeding the registry's hysteresis."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp

from router.workers import Worker, WorkerRegistry

logger = logging.getLogger(__name__)


class HealthChecker:
    def __init__(self, registry: WorkerRegistry, session: aiohttp.ClientSession, interval: float,
                 timeout: float):
        self.registry = registry
        self.session = session
        self.interval = interval
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._task: asyncio.Task[None] | None = None
        self._probing: set[str] = set()
        self._background: set[asyncio.Task[bool]] = set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def check(self, worker: Worker) -> bool:
        """Probe one worker now and record the result; returns whether it passed."""
        if worker.url in self._probing:  # one probe at a time per worker
            return worker.healthy
        self._probing.add(worker.url)
        try:
            async with self.session.get(worker.url + "/health", timeout=self.timeout) as resp:
                await resp.read()
                ok, why = resp.status == 200, f"/health answered {resp.status}"
        except aiohttp.ClientConnectorError as exc:
            # Nothing listens there: no reason to wait for more failures.
            self.registry.failed(worker, f"cannot connect: {exc}", hard=True)
            return False
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            ok, why = False, f"/health failed: {type(exc).__name__}: {exc}"
        finally:
            self._probing.discard(worker.url)
        if ok:
            self.registry.check_passed(worker)
        else:
            self.registry.failed(worker, why)
        return ok

    def check_soon(self, worker: Worker) -> None:
        """Probe in the background (after a failed request, to learn fast whether the worker is gone)."""
        task = asyncio.get_running_loop().create_task(self.check(worker))
        self._background.add(task)  # keep a reference until it ends
        task.add_done_callback(self._background.discard)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            workers = list(self.registry)
            if workers:
                try:
                    await asyncio.gather(*(self.check(w) for w in workers))
                except Exception:  # never let one bad probe stop the checker
                    logger.exception("health check round failed")
