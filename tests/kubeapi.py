"""A local stand-in for the Kubernetes API server's list/watch protocol, for discovery tests.

Serves pods (`/api/v1/namespaces/{ns}/pods`) and EndpointSlices
(`/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices`) with what a real API server does
that a client must handle: a global resourceVersion; paged lists (`limit`/`continue`); equality
label selectors; watches from a resourceVersion (history replayed, then live events) as chunked
JSON lines, each event deliberately split over two chunks; BOOKMARK events (with
`allowWatchBookmarks`); server-side `timeoutSeconds`; and, once `compact()` dropped the history a
watch asks for, an ERROR event with a 410 Status (an expired continue token: HTTP 410).

The test thread changes objects (`put`, `delete`) while the server runs in its own thread:
watchers get events through their loop's call_soon_threadsafe.
"""
from __future__ import annotations

import asyncio
import copy
import json
import threading
from typing import Any
from urllib.parse import parse_qs

PODS, SLICES = "pods", "endpointslices"
PREFIXES = {"/api/v1/namespaces/": PODS, "/apis/discovery.k8s.io/v1/namespaces/": SLICES}
KINDS = {PODS: ("Pod", "v1"), SLICES: ("EndpointSlice", "discovery.k8s.io/v1")}


def _gone(message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": "Expired", "code": 410}


def _flag(value: str | None) -> bool:
    """Booleans as the API server parses them (Go's strconv.ParseBool): the client sends `True`."""
    return (value or "").lower() in ("1", "t", "true")


def _matches(obj: dict, selector: str | None) -> bool:
    labels = obj["metadata"].get("labels") or {}
    for term in filter(None, (selector or "").split(",")):
        key, _, value = term.partition("=")
        if labels.get(key.strip()) != value.strip():
            return False
    return True


class KubeApiStandIn:
    def __init__(self, bookmark_interval_s: float = 0.2) -> None:
        self.bookmark_interval_s = bookmark_interval_s
        self._lock = threading.Lock()
        self.rv = 1000
        self.oldest = 0  # watches from a resourceVersion below this get 410
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.history: list[tuple[int, str, str, str, dict]] = []  # (rv, event type, resource, ns, object)
        self.watchers: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue, str, str, str | None]] = []
        self.lists = 0  # list requests served (a relist shows here)
        self.watches = 0
        self.gone_sent = 0

    # -- changes from the test ---------------------------------------------------------------

    def put(self, resource: str, obj: dict) -> None:
        obj = copy.deepcopy(obj)
        kind, api = KINDS[resource]
        obj.setdefault("kind", kind)
        obj.setdefault("apiVersion", api)
        meta = obj["metadata"]
        meta.setdefault("namespace", "default")
        key = (resource, meta["namespace"], meta["name"])
        with self._lock:
            event = "MODIFIED" if key in self.objects else "ADDED"
            self.objects[key] = obj
            self._record(event, resource, meta["namespace"], obj)

    def delete(self, resource: str, name: str, namespace: str = "default") -> None:
        with self._lock:
            obj = self.objects.pop((resource, namespace, name))
            self._record("DELETED", resource, namespace, obj)

    def compact(self) -> None:
        """Forget the history: every resourceVersion handed out so far is now too old."""
        with self._lock:
            self.rv += 1
            self.oldest = self.rv
            self.history.clear()

    def end_watches(self) -> None:
        """End every open watch (an API server restart or a load balancer cutting connections)."""
        with self._lock:
            for loop, queue, *_ in self.watchers:
                loop.call_soon_threadsafe(queue.put_nowait, None)

    def _record(self, event: str, resource: str, ns: str, obj: dict) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        snapshot = copy.deepcopy(obj)
        self.history.append((self.rv, event, resource, ns, snapshot))
        for loop, queue, w_resource, w_ns, selector in self.watchers:
            if w_resource == resource and w_ns == ns and _matches(snapshot, selector):
                loop.call_soon_threadsafe(queue.put_nowait, {"type": event, "object": snapshot})

    # -- HTTP ----------------------------------------------------------------------------------

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path, query = scope["path"], {k: v[-1] for k, v in parse_qs(scope["query_string"].decode()).items()}
        for prefix, resource in PREFIXES.items():
            rest = path[len(prefix):].split("/") if path.startswith(prefix) else []
            if len(rest) == 2 and rest[1] == resource:
                if _flag(query.get("watch")):
                    await self._watch(send, resource, rest[0], query)
                else:
                    await self._list(send, resource, rest[0], query)
                return
        await self._json(send, 404, {"kind": "Status", "code": 404, "message": f"no route {path}"})

    @staticmethod
    async def _json(send: Any, status: int, body: dict) -> None:
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})

    async def _list(self, send: Any, resource: str, ns: str, query: dict) -> None:
        with self._lock:
            self.lists += 1
            if "continue" in query:
                rv, offset = (int(x) for x in query["continue"].split(":"))
                if rv < self.oldest:
                    await self._json(send, 410, _gone("The provided continue parameter is too old"))
                    return
            else:
                rv, offset = self.rv, 0
            items = sorted(
                (o for (r, n, _), o in self.objects.items() if r == resource and n == ns and _matches(o, query.get("labelSelector"))),
                key=lambda o: o["metadata"]["name"],
            )
            items = copy.deepcopy(items)
        limit = int(query.get("limit") or 0) or len(items) or 1
        page = items[offset:offset + limit]
        meta: dict = {"resourceVersion": str(rv)}
        if offset + limit < len(items):
            meta["continue"] = f"{rv}:{offset + limit}"
        kind, api = KINDS[resource]
        await self._json(send, 200, {"kind": kind + "List", "apiVersion": api, "metadata": meta, "items": page})

    async def _watch(self, send: Any, resource: str, ns: str, query: dict) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        selector = query.get("labelSelector")
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        with self._lock:
            self.watches += 1
            since = int(query.get("resourceVersion") or 0)
            if since and since < self.oldest:
                self.gone_sent += 1
                backlog = [{"type": "ERROR", "object": _gone(f"too old resource version: {since} ({self.oldest})")}]
                watcher = None
            else:
                backlog = [
                    {"type": event, "object": copy.deepcopy(obj)} for rv, event, r, n, obj in self.history
                    if rv > since and r == resource and n == ns and _matches(obj, selector)
                ]
                watcher = (loop, queue, resource, ns, selector)
                self.watchers.append(watcher)
            current = self.rv
        try:
            for event in backlog:
                await self._event(send, event)
            if watcher is None:
                return
            deadline = loop.time() + float(query.get("timeoutSeconds") or 1800)
            bookmarks = _flag(query.get("allowWatchBookmarks"))
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    event = await asyncio.wait_for(queue.get(), min(left, self.bookmark_interval_s))
                except asyncio.TimeoutError:
                    if bookmarks:
                        with self._lock:
                            current = self.rv
                        kind, api = KINDS[resource]
                        await self._event(send, {"type": "BOOKMARK", "object": {
                            "kind": kind, "apiVersion": api, "metadata": {"resourceVersion": str(current)}}})
                    continue
                if event is None:
                    break
                await self._event(send, event)
        finally:
            if watcher is not None:
                with self._lock:
                    self.watchers.remove(watcher)
            await send({"type": "http.response.body", "body": b""})

    @staticmethod
    async def _event(send: Any, event: dict) -> None:
        line = json.dumps(event).encode() + b"\n"
        half = len(line) // 2  # a line split over two chunks: the client must reassemble it
        await send({"type": "http.response.body", "body": line[:half], "more_body": True})
        await send({"type": "http.response.body", "body": line[half:], "more_body": True})


def pod(name: str, ip: str, port: int, *, ready: bool, labels: dict | None = None, annotations: dict | None = None,
        terminating: bool = False, namespace: str = "default") -> dict:
    meta: dict = {"name": name, "namespace": namespace, "labels": {"app": "vllm", **(labels or {})}, "uid": f"uid-{name}"}
    if annotations:
        meta["annotations"] = annotations
    if terminating:
        meta["deletionTimestamp"] = "2026-11-30T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {"containers": [{"name": "vllm", "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"phase": "Running", "podIP": ip,
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def endpoint_slice(name: str, service: str, port: int, endpoints: list[tuple[str, str, bool, bool]],
                   namespace: str = "default", labels: dict | None = None) -> dict:
    """endpoints: (pod name, ip, ready, terminating)."""
    return {
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"kubernetes.io/service-name": service, **(labels or {})}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [
            {"addresses": [ip], "conditions": {"ready": ready, "serving": ready or terminating, "terminating": terminating},
             "targetRef": {"kind": "Pod", "name": pod_name, "namespace": namespace}}
            for pod_name, ip, ready, terminating in endpoints
        ],
    }
