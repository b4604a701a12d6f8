"""A worker server joining a router's pool at runtime (`foveal serve --router URL`).

Registration is retried in the background until the router accepts it: the
router health-checks the worker first, and the worker only answers once its
HTTP server is listening, just after startup. On shutdown the worker leaves
the pool, so the router stops sending it requests before it goes away.
"""
from __future__ import annotations

import asyncio

import httpx

from foveal.logger import init_logger

logger = init_logger(__name__)


class RouterRegistration:
    def __init__(self, router_url: str, role: str, worker_url: str,
                 api_key: str | None = None, retry_s: float = 0.5,
                 give_up_s: float = 120.0) -> None:
        self.endpoint = router_url.rstrip("/") + "/router/workers"
        self.body = {"role": role, "url": worker_url}
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.retry_s, self.give_up_s = retry_s, give_up_s
        self.registered = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._register())

    async def _register(self) -> None:
        deadline = asyncio.get_running_loop().time() + self.give_up_s
        async with httpx.AsyncClient(timeout=10.0) as client:
            while True:
                try:
                    answer = await client.post(self.endpoint, json=self.body,
                                               headers=self.headers)
                    if answer.status_code == 200:
                        self.registered.set()
                        logger.info("joined the %s pool of %s", self.body["role"], self.endpoint)
                        return
                    note = f"HTTP {answer.status_code}: {answer.text[:200]}"
                except httpx.HTTPError as error:
                    note = repr(error)
                if asyncio.get_running_loop().time() > deadline:
                    logger.error("could not join %s: %s", self.endpoint, note)
                    return
                await asyncio.sleep(self.retry_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if not self.registered.is_set():
            return
        try:
            async with httpx.AsyncClient(timeout=5.0) as client:
                await client.request("DELETE", self.endpoint, json=self.body,
                                     headers=self.headers)
        except httpx.HTTPError as error:  # the router may be gone already
            logger.warning("could not leave %s: %r", self.endpoint, error)
