"""The modules compiled to C with mypyc when the package is built, and what a running process has.

The routing decision of `prefix_affinity` is a few thousand interpreted bytecodes per request
(prefix keys, the load bound, tenant shares, the balance guard), spread over small functions with
no single hotspot: compiled, the same source decides the same way in about half the instructions
(loadtest.pick_cost). The request's path around it (parse, scheduler, the callback-driven
exchange and the task path, the upstream client, metrics, the access log) is compiled too: ~19 %
fewer instructions a request (loadtest.instructions); so are the server protocol's reads and
parser callbacks (proxy/intake.py) and the small per-request helpers (retry budget, admission,
outliers): another ~10 %. Not compiled: the server protocol itself (it subclasses uvicorn's and
is configured through class attributes), proxy/spec.py and the routing filters (interpreted
subclasses), the shared state (background I/O). setup.py compiles these
modules when mypyc is at hand, and the package runs as plain Python when it is not
(`VLLM_PROXY_COMPILE=0` at build time, or no compiler): both are the same code, so every test
holds for both (compiled code checks declared types: a declaration must be true, not merely
accepted by mypy).

Python imports an extension in preference to its source, so a source edited after an in-place
build would be shadowed by the old extension. `use_sources_if_stale` (run when `proxy` is
imported) therefore imports every module of the group from source when any source of the package
differs from what it was compiled with (setup.py records their digests in proxy/native_built.py;
interpreted modules count too: compiled code checks the types they declare), or when
`VLLM_PROXY_NATIVE=0`: all or none, as compiled modules call each other directly, not through the
module. `make` rebuilds the extensions after an edit.
"""
from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import runpy
import sys
from pathlib import Path

# dotted names, compiled together (calls between them skip the interpreter); setup.py reads this
MODULES = (
    "proxy.prefix",
    "proxy.routing.backends",
    "proxy.routing.index",
    "proxy.routing.affinity.counts",
    "proxy.routing.affinity.load",
    "proxy.routing.affinity.tenants",
    "proxy.routing.affinity.ranking",
    "proxy.routing.affinity.table",
    "proxy.routing.affinity.placement",
    "proxy.routing.affinity.balance",
    "proxy.routing.affinity.policy",
    # the request path around it
    "proxy.parse",
    "proxy.accesslog",
    "proxy.http1",
    "proxy.forward",
    "proxy.routing.scheduler",
    "proxy.fastpath",
    "proxy.cycle",
    "proxy.intake",
    "proxy.retry",
    "proxy.admission",
    "proxy.outlier",
    "proxy.inference",
    "proxy.metrics",
)
GROUP = "vllm_proxy_native"  # the shared library's name (<GROUP>__mypyc), beside the package
RECORD = "native_built.py"  # in the package: the digests of the sources compiled (setup.py writes it)

_ROOT = Path(__file__).resolve().parent.parent
why_sources = ""  # why this process runs MODULES from source although they are compiled ("": it does not)


def compiled() -> list[str]:
    """The modules of MODULES that this process imports as extensions."""
    out = []
    for name in MODULES:
        spec = importlib.util.find_spec(name)
        if spec is not None and isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            out.append(name)
    return out


def describe() -> str:
    """'compiled', or 'interpreted' and why (the startup log line says it)."""
    if len(compiled()) == len(MODULES):
        return "compiled"
    return f"interpreted ({why_sources or 'not compiled at install'})"


def _source(name: str) -> Path:
    return _ROOT.joinpath(*name.split(".")).with_suffix(".py")


def digests() -> dict[str, str]:
    """The digest of every source file of the package, by path (setup.py records them in
    proxy/native_built.py): the compiled modules, and the interpreted ones whose types compiled
    code checks at run time (an edit there could break what was compiled against it)."""
    package = _ROOT / "proxy"
    return {str(path.relative_to(_ROOT)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(package.rglob("*.py")) if path.name != RECORD}


def stale() -> list[str]:
    """The compiled modules present, when the package's sources differ from those they were built
    with (by content, not by time: a wheel's installer writes the sources after the extensions),
    or the group library they call into, or the record of what was compiled, is missing (a build
    that failed half way); else none."""
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    present = [name for name in MODULES
               if any(_source(name).with_suffix(suffix).exists() for suffix in suffixes)]
    if not present:
        return []
    group = any(_ROOT.joinpath(f"{GROUP}__mypyc{suffix}").exists() for suffix in suffixes)
    record = _ROOT / "proxy" / RECORD
    built = runpy.run_path(str(record)).get("DIGESTS", {}) if record.exists() else {}
    if not group or not built or built != digests():
        return present
    return []


class _Sources(importlib.abc.MetaPathFinder):
    """Finds MODULES as their source files (ahead of the extensions beside them)."""

    def find_spec(self, name: str, path: object = None, target: object = None):
        if name not in MODULES:
            return None
        return importlib.util.spec_from_file_location(name, _source(name))


def use_sources_if_stale() -> None:
    """Import MODULES from source if `VLLM_PROXY_NATIVE=0` or some extension is stale."""
    global why_sources
    if any(isinstance(f, _Sources) for f in sys.meta_path):
        return
    if os.environ.get("VLLM_PROXY_NATIVE") == "0":
        why_sources = "VLLM_PROXY_NATIVE=0"
    else:
        old = stale()
        if not old:
            return
        why_sources = "the package's sources differ from what was compiled, or the build failed (make rebuilds it)"
    sys.meta_path.insert(0, _Sources())
