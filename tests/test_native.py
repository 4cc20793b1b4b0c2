"""The compiled routing modules (proxy/native.py): the same decisions as their source, and an
edited source is never shadowed by its old extension."""
from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from proxy import native

ROOT = Path(__file__).resolve().parents[1]

# a replay of the affinity benchmark (placement, growth, the balance guard, the packing repair)
# whose every number is printed exactly: any decision that differs changes some of them
_REPLAY = """
import json, sys
from loadtest.affinity_replay import replay
from proxy import native
r = replay("weak", 1, 1500, {}, 160.0, 16, slow=1)
print(json.dumps({"compiled": native.compiled(), "share": repr(r["share"]), "quarters": [repr(q) for q in r["quarters"]],
                  "reasons": sorted(r["reasons"].items()), "lost": sorted(r["lost"].items()),
                  "prefill_p99": r["prefill_p99"], "cold_slow": r["cold_slow"]}))
"""


def _replay(native_on: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("VLLM_PROXY_NATIVE", None)
    if not native_on:
        env["VLLM_PROXY_NATIVE"] = "0"
    out = subprocess.run([sys.executable, "-c", _REPLAY], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not native.compiled(), reason="the routing modules are not compiled in this checkout")
def test_compiled_modules_decide_like_their_source() -> None:
    compiled, source = _replay(True), _replay(False)
    assert compiled.pop("compiled") == list(native.MODULES)
    assert source.pop("compiled") == []
    assert compiled == source


def test_a_stale_extension_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "proxy"
    package.mkdir()
    source = package / "prefix.py"
    source.write_text("X = 1\n")
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    source.with_suffix(suffix).write_bytes(b"")
    monkeypatch.setattr(native, "MODULES", ("proxy.prefix",))
    monkeypatch.setattr(native, "_ROOT", tmp_path)
    record = package / "native_built.py"
    record.write_text(f"DIGESTS = {native.digests()!r}\n")
    assert native.stale() == ["proxy.prefix"]  # no group library: a build that failed half way
    (tmp_path / f"{native.GROUP}__mypyc{suffix}").write_bytes(b"")
    assert native.stale() == []
    os.utime(source, (4_000_000_000, 4_000_000_000))  # newer, the same content (a wheel's install)
    assert native.stale() == []
    source.write_text("X = 2\n")  # edited after the build
    assert native.stale() == ["proxy.prefix"]
    source.write_text("X = 1\n")
    record.unlink()  # what was compiled is unknown
    assert native.stale() == ["proxy.prefix"]


def test_sources_are_imported_when_asked() -> None:
    probe = ("import proxy.routing.affinity.policy as p, proxy.prefix as x; from proxy import native; "
             "print(p.__file__, x.__file__, repr(native.why_sources))")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_PROXY_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    policy, prefix, why = out.stdout.split()
    assert policy.endswith("policy.py") and prefix.endswith("prefix.py")
    assert why == "'VLLM_PROXY_NATIVE=0'"


_PURE = {"len", "min", "max", "int"}  # calls a slice bound may make: evaluating them twice changes nothing


def _twice_evaluated(source: str) -> list[int]:
    """Lines where a slice bound calls something with a possible side effect: compiled, mypyc
    evaluates a bound of `x[a:b]` twice on a sequence it does not know (`view[os.write(fd, view):]`
    wrote every access-log line twice)."""
    import ast

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Slice):
            for bound in (node.lower, node.upper, node.step):
                for call in ast.walk(bound) if bound is not None else ():
                    if isinstance(call, ast.Call) and not (isinstance(call.func, ast.Name) and call.func.id in _PURE):
                        lines.append(node.lineno)
    return lines


def test_compiled_modules_have_no_slice_bound_with_side_effects() -> None:
    assert _twice_evaluated("view = view[os.write(fd, view):]\n") == [1]
    assert _twice_evaluated("rest = data[len(data) - keep:]\n") == []
    found = {name: _twice_evaluated((ROOT / (name.replace(".", "/") + ".py")).read_text()) for name in native.MODULES}
    assert {name: lines for name, lines in found.items() if lines} == {}
