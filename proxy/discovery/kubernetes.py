"""Replicas from the Kubernetes API, with the official async client (kubernetes_asyncio): the
EndpointSlices of a Service, or pods by label selector, kept current by the informer pattern.

List (paged) and remember the list's resourceVersion; watch from it with bookmarks (the server's
resourceVersion keeps advancing during quiet times, so a reconnect rarely falls behind); each
watch request ends after `watch_timeout_s` and the next resumes from the last version seen. When
the server has compacted that version away it answers 410 Gone: list again and reconcile, which
also catches deletions missed while disconnected. Any other failure keeps the known set and
retries with a backoff (an unreachable API server must not drain the fleet).

Readiness: an EndpointSlice endpoint is routable when `ready` (unset counts as ready) and not
`terminating`; a pod when it has an IP, its Ready condition is True and it has no deletionTimestamp.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import orjson

from proxy.config import BackendSource
from proxy.discovery.fleet import Fleet, Found
from proxy.tasks import Supervisor

log = logging.getLogger("vllm_proxy.discovery")

NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
PAGE = 500
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.5, 30.0
FIRST_LIST_S = 10.0  # the proxy starts (not ready) rather than wait longer for an API server


class Gone(Exception):
    """The resourceVersion we hold is too old (HTTP 410): list again."""


def _overrides(meta: dict, prefix: str) -> dict:
    """Per-replica settings from labels and annotations (annotations win)."""
    values = {**(meta.get("labels") or {}), **(meta.get("annotations") or {})}
    out: dict = {}
    for key in ("models", "adapters"):
        text = values.get(prefix + key)
        if text is not None:
            out[key] = [v.strip() for v in text.split(",") if v.strip()]
    trust = values.get(prefix + "trust-request-mm-kwargs")
    if trust is not None:
        out["trust_request_mm_kwargs"] = trust.strip().lower() == "true"
    return out


def pod_replicas(pods: dict[str, dict], port: int | str | None, prefix: str) -> list[Found]:
    found = []
    for name, pod in pods.items():
        status, meta = pod.get("status") or {}, pod.get("metadata") or {}
        ip = status.get("podIP")
        number = _pod_port(pod, port)
        if not ip or number is None:
            continue
        ready = (
            not meta.get("deletionTimestamp")
            and any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())
        )
        found.append(Found(name, ip, number, bool(ready), _overrides(meta, prefix)))
    return found


def _pod_port(pod: dict, port: int | str | None) -> int | None:
    if isinstance(port, int):
        return port
    for container in (pod.get("spec") or {}).get("containers") or ():
        for p in container.get("ports") or ():
            if port is None or p.get("name") == port:
                return p.get("containerPort")
    return None


def slice_replicas(slices: dict[str, dict], port: int | str | None, prefix: str) -> list[Found]:
    found = []
    for s in slices.values():
        number = _slice_port(s, port)
        if number is None:
            continue
        overrides = _overrides(s.get("metadata") or {}, prefix)
        for ep in s.get("endpoints") or ():
            addresses = ep.get("addresses") or ()
            if not addresses:
                continue
            cond = ep.get("conditions") or {}
            ready = cond.get("ready") is not False and not cond.get("terminating")
            ref = ep.get("targetRef") or {}
            key = ref.get("name") if ref.get("kind") == "Pod" and ref.get("name") else addresses[0]
            found.append(Found(key, addresses[0], number, ready, overrides))
    return found


def _slice_port(s: dict, port: int | str | None) -> int | None:
    if isinstance(port, int):
        return port
    for p in s.get("ports") or ():
        if port is None or p.get("name") == port:
            return p.get("port")
    return None


class KubernetesDiscovery:
    def __init__(self, source: BackendSource, fleet: Fleet) -> None:
        assert source.kubernetes is not None
        self.source = source
        self.config = source.kubernetes
        self.fleet = fleet
        self.namespace = self.config.namespace or _own_namespace()
        self.objects: dict[str, dict] = {}  # name -> the latest EndpointSlice or pod seen
        self.resource_version: str | None = None
        self.synced = asyncio.Event()  # set after each successful (re)list; tests wait on it
        self.relists = 0
        self._api = None
        self._tasks: Supervisor | None = None

    # -- client ------------------------------------------------------------------------------

    async def _client(self):
        if self._api is None:
            from kubernetes_asyncio import client, config  # optional dependency: vllm-proxy[kubernetes]

            conf = client.Configuration()
            if self.config.api_server is None:
                config.load_incluster_config(client_configuration=conf)
            else:
                conf.host = self.config.api_server
            api = client.ApiClient(configuration=conf)
            if self.config.service is not None:
                self._list_fn = client.DiscoveryV1Api(api).list_namespaced_endpoint_slice
                self._selector = f"kubernetes.io/service-name={self.config.service}"
            else:
                self._list_fn = client.CoreV1Api(api).list_namespaced_pod
                self._selector = self.config.selector
            self._api = api
        return self._api

    # -- list + watch --------------------------------------------------------------------------

    def publish(self) -> None:
        cfg = self.config
        pick = slice_replicas if cfg.service is not None else pod_replicas
        self.fleet.update(self.source, pick(self.objects, cfg.port, cfg.annotation_prefix))

    async def relist(self) -> None:
        await self._client()
        objects: dict[str, dict] = {}
        cont = None
        while True:
            resp = await self._list_fn(
                self.namespace, label_selector=self._selector, limit=PAGE, _continue=cont,
                _preload_content=False, _request_timeout=60,
            )
            async with resp:
                body = await resp.read()
                if resp.status == 410:  # the continue token expired: start over
                    raise Gone()
                if resp.status != 200:
                    raise RuntimeError(f"list: HTTP {resp.status}: {body[:200]!r}")
            page = orjson.loads(body)
            for item in page.get("items") or ():
                objects[item["metadata"]["name"]] = item
            meta = page.get("metadata") or {}
            cont = meta.get("continue")
            if not cont:
                break
        self.objects = objects
        self.resource_version = meta.get("resourceVersion")
        self.relists += 1
        self.publish()
        self.synced.set()

    async def watch(self) -> None:
        """One watch request, from `resource_version` until the server ends it."""
        from kubernetes_asyncio import watch
        from kubernetes_asyncio.client.exceptions import ApiException

        w = watch.Watch()
        try:
            stream = w.stream(
                self._list_fn, self.namespace, label_selector=self._selector,
                resource_version=self.resource_version, allow_watch_bookmarks=True,
                timeout_seconds=self.config.watch_timeout_s, _request_timeout=self.config.watch_timeout_s + 30,
            )
            async for event in stream:
                kind, obj = event["type"], event["raw_object"]
                if kind in ("ADDED", "MODIFIED"):
                    self.objects[obj["metadata"]["name"]] = obj
                elif kind == "DELETED":
                    self.objects.pop(obj["metadata"]["name"], None)
                if w.resource_version:
                    self.resource_version = w.resource_version  # bookmarks advance it too
                if kind != "BOOKMARK":
                    self.publish()
        except ApiException as exc:
            if exc.status == 410:
                raise Gone() from None
            raise
        finally:
            await w.close()

    async def _run(self) -> None:
        pause = BACKOFF_FIRST_S
        while True:
            try:
                if self.resource_version is None:
                    await self.relist()
                await self.watch()
                pause = BACKOFF_FIRST_S
                continue
            except Gone:
                log.info("source %s: resourceVersion %s expired, listing again", self.source.name, self.resource_version)
                self.resource_version = None
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep the known set; retry
                log.warning("source %s: Kubernetes API: %s (retrying in %.1fs)", self.source.name, exc or type(exc).__name__, pause)
            await asyncio.sleep(pause)
            pause = min(pause * 2, BACKOFF_MAX_S)

    async def start(self, tasks: Supervisor) -> None:
        self._tasks = tasks = tasks.child(f"source {self.source.name}")
        try:
            await asyncio.wait_for(self.relist(), FIRST_LIST_S)
        except Exception as exc:  # the loop below keeps trying
            self.resource_version = None
            log.warning("source %s: first list failed: %s", self.source.name, exc or type(exc).__name__)
        tasks.spawn(self._run(), f"source {self.source.name}: Kubernetes watch")

    async def stop(self) -> None:
        if self._tasks is not None:
            await self._tasks.stop()
        if self._api is not None:
            await self._api.close()


def _own_namespace() -> str:
    try:
        return NAMESPACE_FILE.read_text().strip() or "default"
    except OSError:
        return "default"
