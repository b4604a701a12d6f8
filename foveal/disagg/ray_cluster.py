"""Disaggregated serving on Ray: one actor per worker server, so the encode,
prefill and decode pools of a `foveal router` span the hosts of a Ray cluster
(`ray start --head` on one, `ray start --address HEAD:6379` on the others).

`WorkerActor` is the actor body. Through a guard process (`supervise`) it
starts `foveal serve MODEL --role ROLE` on its node, bound to the node's IP and
a free port, with `--router URL`, so the server joins the router's pool by
itself once it serves and leaves it on SIGINT. The server runs in its own
session: its engine core and preprocessing processes are its children, and
stopping the session stops them all.

`RayCluster` is the driver side: it places one actor per worker (`num_cpus`,
`num_gpus` per actor, so Ray places workers by cores and devices), waits until
each serves and is in the router's pool, and stops them again. Every wait is
bounded; what fails raises `WorkerStartError` with the tail of the server's log.

When an actor dies (killed, crashed, its driver gone), the guard, which is no
child of the actor and so outlives it, sees the end of a pipe only the actor
held and stops the server as `stop` would: it leaves the pool. That needs
POSIX (fork, sessions, select on pipes). When a whole node is lost, the
router's health checks take its workers out (--remove-after). Actors are not
restarted: `prune_dead` drops dead ones, a caller adds new workers. The model
folder (and foveal) must be at the same path on every node, and the router
reachable from every node. One file for both sides of one protocol (the
actor's pipes and the driver's calls), hence over 300 lines.
"""
from __future__ import annotations

import atexit
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

import foveal
from foveal.disagg.launch import poll_health
from foveal.errors import ConfigError, FovealError
from foveal.executor.ranks import free_port, startup_timeout_s
from foveal.logger import init_logger

logger = init_logger(__name__)

WORKER_ROLES = ("encode", "prefill", "decode", "mixed")
# flags the cluster sets per worker; serve_args may not set them
MANAGED_FLAGS = ("--role", "--host", "--port", "--router", "--router-api-key", "--transfer-host")
PLACEMENT_TIMEOUT_S = 120.0  # Ray finding a node with the resources one worker asks for
CALL_SLACK_S = 15.0  # an actor call's own overhead, on top of what it waits for
_SUPERVISE_CODE = "import sys; from foveal.disagg.ray_cluster import supervise; supervise(*sys.argv[1:])"


class WorkerStartError(FovealError):
    """A worker server on Ray did not start, serve or join the router's pool in time."""


class _CallTimeout(WorkerStartError):
    """An actor call ran past its deadline."""


@dataclass(frozen=True)
class ClusterWorker:
    """A worker server of the cluster: its role and the base URL it serves (and is pooled) at."""
    role: str
    url: str


def _signal_group(pgid: int, signum: int) -> bool:
    """Signals a process group; False when no process of it is left."""
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        return False
    return True


def supervise(grace_s: str, *command: str) -> None:
    """The guard (`python -c`, started by the actor): runs `command`, the
    server, in its own session and writes its pid, then its exit code, to
    stdout, a pipe the actor reads. It forks first, so it is no child of the
    actor: when an actor ends, Ray SIGKILLs the actor's children, which would
    orphan the server's engine core. Once stdin, a pipe only the actor holds,
    ends (the actor stopped the server or died, however), or the server exits,
    the guard stops the server's session: SIGINT (the server leaves the
    router's pool), then SIGKILL after `grace_s` for what is left."""
    if os.fork():
        os._exit(0)  # the actor reaps this parent at once
    server = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(),
                              stderr=subprocess.STDOUT, start_new_session=True)
    os.write(1, f"{server.pid}\n".encode())
    while server.poll() is None:
        ready, _, _ = select.select([0], [], [], 0.5)
        if ready and not os.read(0, 256):
            break
    if server.poll() is None and _signal_group(server.pid, signal.SIGINT):
        try:
            server.wait(float(grace_s))
        except subprocess.TimeoutExpired:
            pass
    _signal_group(server.pid, signal.SIGKILL)  # stragglers: engine core, preprocessing pool
    os.write(1, f"{server.wait()}\n".encode())


def pool_of(role: str) -> str:
    """The router pool a worker of `role` joins (a mixed server serves whole requests: decode)."""
    return "decode" if role == "mixed" else role


class WorkerActor:
    """The actor body: one `foveal serve --role ROLE` server on the actor's node,
    run by a guard process (`supervise`) the actor talks to through two pipes."""

    def __init__(self, model: str, role: str, router_url: str, serve_args: tuple[str, ...],
                 router_api_key: str | None = None, stop_grace_s: float = 30.0,
                 package_root: str | None = None) -> None:
        import ray

        self.role, self.stop_grace_s, self.package_root = role, stop_grace_s, package_root
        self.host, self.port = ray.util.get_node_ip_address(), free_port()
        self.gcs_address = ray.get_runtime_context().gcs_address
        self.log_path = Path(tempfile.mkdtemp(prefix=f"foveal-{role}-")) / "server.log"
        key_flags = ["--router-api-key", router_api_key] if router_api_key else []
        self.command = [sys.executable, "-m", "foveal", "serve", model, "--role", role,
                        "--host", self.host, "--port", str(self.port), "--transfer-host", self.host,
                        "--router", router_url, *key_flags, *serve_args]
        self._control: int | None = None  # write end of the guard's stdin: closing it stops
        self._status: int | None = None  # read end of the guard's stdout: pid, exit code, EOF
        self._status_lines: list[str] = []
        atexit.register(self.stop)

    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> str:
        """Starts the guard and through it the server; returns the server's URL at once."""
        control_read, self._control = os.pipe()
        self._status, status_write = os.pipe()
        try:
            with open(self.log_path, "wb") as log:
                launcher = subprocess.Popen(
                    [sys.executable, "-c", _SUPERVISE_CODE, str(self.stop_grace_s), *self.command],
                    stdin=control_read, stdout=status_write, stderr=log, start_new_session=True,
                    env=self._server_env())
        finally:
            os.close(control_read)
            os.close(status_write)
        launcher.wait(CALL_SLACK_S)  # it forks the guard and exits
        deadline = time.monotonic() + CALL_SLACK_S
        while not self._status_lines and self._read_status(deadline - time.monotonic()):
            if time.monotonic() > deadline:
                break
        if not self._status_lines:
            raise WorkerStartError(f"the guard of the {self.role} server did not start it; "
                                   f"{self.log_tail()}")
        return self.url()

    def _server_env(self) -> dict[str, str]:
        env = dict(os.environ)  # Ray's CUDA_VISIBLE_DEVICES and OMP_NUM_THREADS included
        env["PYTHONUNBUFFERED"] = "1"  # the log tail in errors is current
        if self.package_root and os.path.isdir(self.package_root):
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [self.package_root,
                                                              env.get("PYTHONPATH")]))
        # `--distributed-executor-backend ray` in the server joins this cluster
        env.setdefault("RAY_ADDRESS", self.gcs_address)
        return env

    def _read_status(self, timeout_s: float) -> bool:
        """Takes in what the guard wrote within `timeout_s`; False once it has exited."""
        if self._status is None:
            return False
        ready, _, _ = select.select([self._status], [], [], max(0.0, timeout_s))
        if ready:
            chunk = os.read(self._status, 256)
            if not chunk:
                os.close(self._status)
                self._status = None
                return False
            self._status_lines += chunk.decode().split()
        return True

    def server_pid(self) -> int | None:
        """The server's pid, also its process group's id (None before start)."""
        return int(self._status_lines[0]) if self._status_lines else None

    def alive(self) -> bool:
        """Whether the server runs (its guard reported no exit code yet)."""
        return self._read_status(0) and len(self._status_lines) == 1

    def wait_healthy(self, timeout_s: float) -> str:
        """Polls /health until it answers 200; raises if the server exits or the time runs out."""
        state = poll_health(self.url(), time.monotonic() + timeout_s, self.alive)
        if state == "healthy":
            return self.url()
        if state == "exited":
            code = self._status_lines[1] if len(self._status_lines) > 1 else "unknown"
            raise WorkerStartError(f"the {self.role} server at {self.url()} exited (code "
                                   f"{code}) before it served; {self.log_tail()}")
        raise WorkerStartError(f"the {self.role} server at {self.url()} did not answer /health "
                               f"within {timeout_s:g} s (raise the startup timeout); {self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return f"its log ({self.log_path}) ends with:\n{text[-chars:]}"

    def stop(self) -> None:
        """Has the guard stop the server (SIGINT: it leaves the router's pool;
        SIGKILL after the grace period) and waits for it, bounded. Idempotent."""
        if self._control is not None:
            os.close(self._control)
            self._control = None
        deadline = time.monotonic() + self.stop_grace_s + CALL_SLACK_S
        while self._read_status(deadline - time.monotonic()) and time.monotonic() < deadline:
            pass
        if self._status is not None:  # the guard is stuck: end the server's session from here
            logger.warning("the guard of %s did not stop it; killing it", self.url())
            if self.server_pid() is not None:
                _signal_group(self.server_pid(), signal.SIGKILL)
            os.close(self._status)
            self._status = None

    def __del__(self) -> None:  # Ray may not run it: the guard covers a killed actor
        try:
            self.stop()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def check_serve_args(serve_args: tuple[str, ...]) -> None:
    """ConfigError when serve_args set a flag the cluster sets per worker."""
    for arg in serve_args:
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_FLAGS:
            raise ConfigError(f"serve args set {flag}; the cluster sets {', '.join(MANAGED_FLAGS)} "
                              "for each worker (the node's IP, a free port, this router): remove it")


class RayCluster:
    """Worker servers as Ray actors that join the router at `router_url`.
    Starts a Ray instance (`ray_address`, else RAY_ADDRESS, else a local one)
    unless one is running; `shutdown` stops the workers and that instance."""

    def __init__(self, model: str, router_url: str, *, serve_args: tuple[str, ...] = (),
                 ray_address: str | None = None, num_cpus_per_worker: float = 1,
                 num_gpus_per_worker: float = 0, router_api_key: str | None = None,
                 startup_timeout: float | None = None, stop_grace_s: float = 30.0) -> None:
        if num_cpus_per_worker <= 0 or num_gpus_per_worker < 0:
            raise ConfigError(f"--num-cpus-per-worker must be > 0 and --num-gpus-per-worker >= 0, got "
                              f"{num_cpus_per_worker} and {num_gpus_per_worker}")
        check_serve_args(tuple(serve_args))
        try:
            import ray
        except ImportError:
            raise ConfigError("serving on Ray needs Ray: pip install 'foveal[ray]'") from None
        self._ray = ray
        self.model = str(Path(model).resolve()) if Path(model).exists() else model
        self.router_url, self.router_api_key = router_url.rstrip("/"), router_api_key
        self.serve_args, self.stop_grace_s = tuple(serve_args), stop_grace_s
        self.startup_timeout_s = startup_timeout or startup_timeout_s()
        self._resources = {"num_cpus": num_cpus_per_worker, "num_gpus": num_gpus_per_worker}
        self._members: dict[str, tuple[ClusterWorker, object]] = {}  # url -> (worker, actor)
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=ray_address or None, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        self._actor_class = ray.remote(WorkerActor)

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def workers(self) -> list[ClusterWorker]:
        """The running workers, in the order they were added."""
        return [worker for worker, _ in self._members.values()]

    def add_worker(self, role: str) -> str:
        """Starts one worker; returns its URL once it serves and is in the router's pool."""
        return self.add_workers([role])[0]

    def add_workers(self, roles: list[str]) -> list[str]:
        """Starts workers side by side (one per role given); returns their URLs
        once all serve and are in the pool. If one fails, all of them stop."""
        for role in roles:
            if role not in WORKER_ROLES:
                raise ConfigError(f"unknown worker role {role!r}; expected one of "
                                  f"{', '.join(WORKER_ROLES)}")
        deadline = time.monotonic() + self.startup_timeout_s
        package_root = str(Path(foveal.__file__).resolve().parents[1])
        actors = [self._actor_class.options(**self._resources, max_restarts=0).remote(
            self.model, role, self.router_url, self.serve_args, self.router_api_key,
            self.stop_grace_s, package_root) for role in roles]
        try:
            urls = self._placed([actor.start.remote() for actor in actors], deadline)
        except BaseException:
            for actor in actors:  # some may wait for a node: no call reaches them
                self._kill(actor)  # the guard of a server that started stops it
            raise
        try:
            remaining = max(1.0, deadline - time.monotonic())
            self._get([actor.wait_healthy.remote(remaining) for actor in actors],
                      remaining + CALL_SLACK_S, "serve")
            for role, url, actor in zip(roles, urls, actors):
                self._wait_registered(role, url, actor, deadline)
        except BaseException:
            self._stop_all(actors)
            raise
        for role, url, actor in zip(roles, urls, actors):
            self._members[url] = (ClusterWorker(role, url), actor)
            logger.info("%s worker %s joined %s", role, url, self.router_url)
        return urls

    def _placed(self, start_refs: list, deadline: float) -> list[str]:
        timeout_s = min(PLACEMENT_TIMEOUT_S, max(1.0, deadline - time.monotonic()))
        try:
            return self._get(start_refs, timeout_s, "start")
        except _CallTimeout:
            free = self._ray.available_resources()
            raise WorkerStartError(
                f"Ray placed no node for a worker within {timeout_s:.0f} s; each asks for "
                f"{self._resources['num_cpus']:g} CPU(s) and {self._resources['num_gpus']:g} GPU(s), "
                f"the cluster has {free.get('CPU', 0):g} CPU(s) and {free.get('GPU', 0):g} GPU(s) "
                "free: add nodes or lower --num-cpus-per-worker / --num-gpus-per-worker") from None

    def _get(self, refs: list, timeout_s: float, what: str) -> list:
        """ray.get with a deadline; an actor's own error is raised as itself."""
        ray = self._ray
        try:
            return ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise _CallTimeout(f"a worker actor did not answer {what} within {timeout_s:g} s") from None
        except ray.exceptions.RayTaskError as error:
            if isinstance(error.cause, FovealError):
                raise error.cause from None
            raise WorkerStartError(f"a worker actor failed during {what}: {error}") from None
        except ray.exceptions.RayActorError as error:
            raise WorkerStartError(f"a worker actor died during {what}: {error}") from None

    def _wait_registered(self, role: str, url: str, actor, deadline: float) -> None:
        """Polls GET /router/workers until `url` is healthy in its pool."""
        pool = pool_of(role)
        with httpx.Client(timeout=5.0, trust_env=False, headers=self._headers()) as client:
            while time.monotonic() < deadline:
                try:
                    listed = client.get(self.router_url + "/router/workers").json().get(pool, [])
                    if any(worker["url"] == url and worker["healthy"] for worker in listed):
                        return
                except (httpx.HTTPError, ValueError, AttributeError, KeyError):
                    pass
                time.sleep(0.5)
        tail = self._get([actor.log_tail.remote()], CALL_SLACK_S, "log_tail")[0]
        raise WorkerStartError(f"the {role} server at {url} serves but is not in the {pool} pool of "
                               f"{self.router_url} after {self.startup_timeout_s:g} s: can its node "
                               f"reach the router (router --host)? {tail}")

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.router_api_key}"} if self.router_api_key else {}

    def remove_worker(self, role_or_url: str) -> str:
        """Stops a worker (by URL, or the newest of a role); it leaves the pool. Returns its URL."""
        if role_or_url in WORKER_ROLES:
            urls = [url for url, (worker, _) in self._members.items() if worker.role == role_or_url]
        else:
            urls = [url for url in self._members if url == role_or_url.rstrip("/")]
        if not urls:
            raise ConfigError(f"no worker {role_or_url!r} in this cluster; it has "
                              f"{[(worker.role, worker.url) for worker in self.workers()]}")
        worker, actor = self._members.pop(urls[-1])
        self._stop_all([actor])
        self._deregister(worker)
        return worker.url

    def prune_dead(self) -> list[ClusterWorker]:
        """Drops the workers whose actor died or whose server exited; returns them."""
        probes = {url: actor.alive.remote() for url, (_, actor) in self._members.items()}
        dead = []
        for url, probe in probes.items():
            try:
                alive = self._get([probe], CALL_SLACK_S, "alive")[0]
            except FovealError:
                alive = False
            if not alive:
                worker, actor = self._members.pop(url)
                self._stop_all([actor])
                self._deregister(worker)
                dead.append(worker)
        return dead

    def shutdown(self) -> None:
        """Stops every worker (side by side, bounded), then Ray if this cluster started it."""
        members, self._members = list(self._members.values()), {}
        self._stop_all([actor for _, actor in members])
        for worker, _ in members:
            self._deregister(worker)
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()
            self._owns_ray = False

    def _stop_all(self, actors: list) -> None:
        """Stops the actors' servers side by side (bounded), then kills the actors."""
        stops = [actor.stop.remote() for actor in actors]
        if stops:
            _, late = self._ray.wait(stops, num_returns=len(stops),
                                     timeout=self.stop_grace_s + CALL_SLACK_S)
            if late:
                logger.warning("%d worker actor(s) did not stop within %g s; killing them (their "
                               "guards stop the servers)", len(late), self.stop_grace_s + CALL_SLACK_S)
        for actor in actors:
            self._kill(actor)

    def _kill(self, actor) -> None:
        try:
            self._ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def _deregister(self, worker: ClusterWorker) -> None:
        """Takes the worker out of the router's pool, in case it could not leave by itself."""
        body = {"role": pool_of(worker.role), "url": worker.url}
        try:
            answer = httpx.request("DELETE", self.router_url + "/router/workers", json=body,
                                   headers=self._headers(), timeout=5.0, trust_env=False)
        except httpx.HTTPError as error:
            logger.warning("could not take %s out of %s: %r", worker.url, self.router_url, error)
            return
        if answer.status_code not in (200, 404):  # 404: it left by itself
            logger.warning("could not take %s out of %s: HTTP %d %s", worker.url, self.router_url,
                           answer.status_code, answer.text[:200])
