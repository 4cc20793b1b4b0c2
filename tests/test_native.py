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
    source = tmp_path / "proxy" / "prefix.py"
    source.parent.mkdir()
    source.write_text("")
    ext = source.with_suffix(importlib.machinery.EXTENSION_SUFFIXES[0])
    ext.write_bytes(b"")
    monkeypatch.setattr(native, "_ROOT", tmp_path)
    os.utime(source, (1_000, 1_000))
    os.utime(ext, (2_000, 2_000))
    assert native.stale() == ["proxy.prefix"]  # no group library: a build that failed half way
    group = tmp_path / f"{native.GROUP}__mypyc{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    group.write_bytes(b"")
    assert native.stale() == []
    os.utime(source, (3_000, 3_000))
    assert native.stale() == ["proxy.prefix"]


def test_sources_are_imported_when_asked() -> None:
    probe = ("import proxy.routing.affinity.policy as p, proxy.prefix as x; from proxy import native; "
             "print(p.__file__, x.__file__, repr(native.why_sources))")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_PROXY_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    policy, prefix, why = out.stdout.split()
    assert policy.endswith("policy.py") and prefix.endswith("prefix.py")
    assert why == "'VLLM_PROXY_NATIVE=0'"
