"""Config validation: strict keys, key-path messages, and the `check` command's exit codes."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from proxy.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parent.parent


def problems(data: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value.problems


def test_demo_policy_is_valid() -> None:
    config = load_config(ROOT / "policies" / "demo.yaml")
    assert [b.name for b in config.backends] == ["gpu-0", "gpu-1", "gpu-2"]
    assert config.backends[2].trust_request_mm_kwargs


def test_bad_url_is_named_by_key_path() -> None:
    found = problems({"backends": [{"name": "a", "url": "http://x:1"}, {"name": "b", "url": "ftp://x"}]})
    assert found == ["backends[1].url: must be an http:// or https:// base URL, e.g. http://127.0.0.1:8000"]


def test_unknown_keys_and_types_are_errors() -> None:
    found = problems({
        "server": {"port": "eighty", "colour": "blue"},
        "backends": [{"name": "a", "url": "http://x:1", "weight": 3}],
        "routing": {"policy": "random"},
    })
    joined = "\n".join(found)
    assert "server.port:" in joined
    assert "server.colour: unknown key" in joined
    assert "backends[0].weight: unknown key" in joined
    assert "routing.policy:" in joined and "least_loaded" in joined


def test_missing_backends_and_duplicates() -> None:
    assert problems({}) == ["backends: give at least one backend, or set backends_from"]
    dup = problems({"backends": [{"name": "a", "url": "http://x:1"}, {"name": "a", "url": "http://x:2"}]})
    assert dup == ["backends: duplicate name 'a'"]
    assert problems({"backends": [{"name": "a", "url": "http://x:1/v1"}]}) == [
        "backends[0].url: give the base URL without /v1"
    ]


def run_check(tmp_path: Path, text: str) -> subprocess.CompletedProcess:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "proxy", "check", "--config", str(path)], capture_output=True, text=True, cwd=ROOT
    )


def test_check_command_exit_codes(tmp_path: Path) -> None:
    ok = run_check(tmp_path, "backends:\n  - {name: gpu-0, url: 'http://127.0.0.1:8001'}\n")
    assert ok.returncode == 0, ok.stderr
    assert "backend gpu-0" in ok.stdout
    bad = run_check(tmp_path, "backends:\n  - {name: gpu-0, url: 'http://127.0.0.1:8001'}\n  - {name: g1, url: nope}\n")
    assert bad.returncode == 2
    assert "backends[1].url:" in bad.stderr
    broken = run_check(tmp_path, "backends: [\n")
    assert broken.returncode == 2 and "not valid YAML" in broken.stderr
    assert run_check(tmp_path, "- just\n- a list\n").returncode == 2


def test_deployment_multimodal_overrides_are_checked_by_path() -> None:
    found = problems({
        "backends": [{"name": "a", "url": "http://x:1"}],
        "deployments": [{"name": "d", "model": "m"}, {"name": "e", "model": "m", "multimodal": {"mode": "nope"}}],
    })
    assert found == ["deployments[1].multimodal.mode: Input should be 'route_to_trusted', 'reject' or 'allow'"]


def test_readme_configuration_reference_is_current() -> None:
    from proxy.schema_doc import END, START, markdown

    text = (ROOT / "README.md").read_text()
    assert text[text.index(START) + len(START):text.index(END)].strip() == markdown().strip(), (
        "README's configuration reference is stale: run python -m proxy.schema_doc --write README.md"
    )
