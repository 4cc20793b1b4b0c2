"""`vllm-proxy check`: cross-reference mistakes exit 2 naming their key path, and no input, however
odd, gets a traceback (hypothesis over YAML documents)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.checks import cross_check
from proxy.cli import build_parser
from proxy.config import ConfigError, load_config, parse_config

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PINNED = [{"name": "gpu-0", "url": "http://127.0.0.1:9", "models": [MODEL], "adapters": ["sql-lora"]}]


def check(path: str) -> int:
    """`vllm-proxy check --config path`, in this process (without main()'s logging setup)."""
    args = build_parser().parse_args(["check", "--config", path])
    return args.func(args)


def run_check(tmp_path: Path, config: dict | str, capsys) -> tuple[int, str]:
    path = tmp_path / "policy.yaml"
    path.write_text(config if isinstance(config, str) else yaml.safe_dump(config))
    code = check(str(path))
    out = capsys.readouterr()
    return code, out.out + out.err


def test_a_good_policy_passes(tmp_path: Path, capsys) -> None:
    code, out = run_check(tmp_path, {"backends": PINNED, "deployments": [
        {"name": "llama", "model": MODEL}, {"name": "sql", "model": MODEL, "adapter": "sql-lora"},
        {"name": "support", "model": MODEL, "adapter": "support-lora", "adapter_path": "/adapters/support"}]}, capsys)
    assert code == 0 and "OK" in out and "warning" not in out


def test_deployment_model_no_pinned_backend_serves(tmp_path: Path, capsys) -> None:
    code, out = run_check(tmp_path, {"backends": PINNED, "deployments": [
        {"name": "llama", "model": MODEL}, {"name": "qwen", "model": "Qwen/Qwen2.5-7B"}]}, capsys)
    assert code == 2 and "deployments[1].model: no backend serves 'Qwen/Qwen2.5-7B'" in out


def test_adapter_typo(tmp_path: Path, capsys) -> None:
    code, out = run_check(tmp_path, {"backends": PINNED, "deployments": [
        {"name": "sql", "model": MODEL, "adapter": "sql-lroa"}]}, capsys)
    assert code == 2 and "deployments[0].adapter: no backend serving" in out and "'sql-lroa'" in out


def test_key_names_an_unknown_deployment(tmp_path: Path, capsys) -> None:
    code, out = run_check(tmp_path, {"backends": PINNED, "deployments": [{"name": "llama", "model": MODEL}],
                                     "auth": {"keys": [{"name": "team-a", "sha256": "a" * 64,
                                                        "deployments": ["llama", "lama"]}]}}, capsys)
    assert code == 2 and "auth.keys[0].deployments[1]: no deployment is named 'lama'" in out


def test_key_env_unset(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("I21_UNSET_KEY", raising=False)
    config = {"backends": PINNED, "auth": {"keys": [{"name": "team-b", "key_env": "I21_UNSET_KEY"}]}}
    code, out = run_check(tmp_path, config, capsys)
    assert code == 2 and "auth.keys[0].key_env: environment variable I21_UNSET_KEY is not set" in out
    monkeypatch.setenv("I21_UNSET_KEY", "secret")
    assert run_check(tmp_path, config, capsys)[0] == 0


def test_key_file_missing_fails_check_and_serve(tmp_path: Path, capsys) -> None:
    config = {"backends": PINNED, "auth": {"keys": [{"name": "team-c", "key_file": str(tmp_path / "absent")}]}}
    code, out = run_check(tmp_path, config, capsys)
    assert code == 2 and "auth.keys[0].key_file: cannot read" in out
    # serve refuses it before "serving…", with the key path and no traceback
    serve = subprocess.run([sys.executable, "-m", "proxy", "serve", "--config", str(tmp_path / "policy.yaml")],
                           capture_output=True, text=True, timeout=60)
    assert serve.returncode == 2, serve.stderr
    assert "auth.keys[0].key_file: cannot read" in serve.stderr and "Traceback" not in serve.stderr
    assert "serving" not in serve.stdout


def test_network_dependent_references_are_warnings(tmp_path: Path, capsys) -> None:
    code, out = run_check(tmp_path, {"backends": [{"name": "gpu-0", "url": "http://127.0.0.1:9"}],
                                     "deployments": [{"name": "anything", "model": "some/model"}],
                                     "redis": {"url": "redis://127.0.0.1:1/0"}}, capsys)
    assert code == 0
    assert "warning: deployments: anything: not checked against the backends" in out
    assert "warning: redis.url" in out


def test_unreadable_inputs_are_messages(tmp_path: Path, capsys) -> None:
    for text in ("a: 2020-13-45\n", "[" * 5000, "\x00\x01", "backends: &x [*x]\n"):
        code, out = run_check(tmp_path, text, capsys)
        assert code == 2 and "Traceback" not in out and "invalid config" in out, (text[:20], out)
    (tmp_path / "policy.yaml").write_bytes(b"\xff\xfe backends")
    assert check(str(tmp_path / "policy.yaml")) == 2
    assert "not UTF-8" in capsys.readouterr().err


# --- fuzz: any YAML document is either a valid config or a ConfigError with messages ----------

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 70000), st.floats(allow_nan=False),
                     st.text(max_size=12), st.sampled_from([MODEL, "sql-lora", "gpu-0", "http://127.0.0.1:9",
                                                            "I21_FUZZ_ENV", "/nonexistent", "a" * 64]))
_keys = st.sampled_from(["server", "backends", "deployments", "auth", "keys", "name", "url", "models", "adapters",
                         "model", "adapter", "adapter_path", "key_env", "key_file", "sha256", "deployments",
                         "routing", "policy", "redis", "multimodal", "port", "lora", "x"])


def _containers(inner: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(inner, max_size=4) | st.dictionaries(_keys, inner, max_size=5)


_values = st.recursive(_scalars, _containers, max_leaves=25)
_documents = st.dictionaries(_keys, _values, max_size=6)
_backend = st.fixed_dictionaries({"name": st.sampled_from(["gpu-0", "gpu-1"]), "url": st.just("http://127.0.0.1:9")},
                                 optional={"models": st.lists(st.sampled_from([MODEL, "m2"]), max_size=2),
                                           "adapters": st.lists(st.sampled_from(["sql-lora", "x"]), max_size=2)})
_deployment = st.fixed_dictionaries({"name": st.sampled_from(["a", "b", "c"]), "model": st.sampled_from([MODEL, "m2"])},
                                    optional={"adapter": st.sampled_from(["sql-lora", "x", "y"]),
                                              "adapter_path": st.just("/p")})
_key = st.fixed_dictionaries({"name": st.just("k")}, optional={
    "key_env": st.sampled_from(["I21_FUZZ_ENV", "PATH"]), "key_file": st.sampled_from(["/nonexistent", "/etc/hostname"]),
    "sha256": st.just("a" * 64), "deployments": st.lists(st.sampled_from(["a", "b", "zz", MODEL]), max_size=3)})
_near_valid = st.fixed_dictionaries(
    {"backends": st.lists(_backend, min_size=1, max_size=3)},
    optional={"deployments": st.none() | st.lists(_deployment, max_size=4),
              "auth": st.fixed_dictionaries({"keys": st.lists(_key, max_size=3)})})


def _check_document(document: object) -> None:
    try:
        config = parse_config(document)
    except ConfigError as exc:
        assert exc.problems and all(isinstance(p, str) and p for p in exc.problems)
        return
    found = cross_check(config)
    assert all(isinstance(p, str) and p for p in found.errors + found.warnings)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_documents)
def test_fuzz_arbitrary_documents(document: dict) -> None:
    _check_document(document)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_near_valid)
def test_fuzz_near_valid_policies(document: dict) -> None:
    _check_document(document)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.one_of(_documents, _near_valid).map(yaml.safe_dump) | st.text(max_size=200))
def test_fuzz_yaml_text_through_load_config(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "policy.yaml"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))  # lone surrogates make it invalid UTF-8
    try:
        config = load_config(path)
    except ConfigError as exc:
        assert exc.problems
        return
    found = cross_check(config)
    assert all(isinstance(p, str) and p for p in found.errors + found.warnings)


def test_adapter_parent_must_be_a_base_deployment(tmp_path: Path, capsys) -> None:
    code, out = run_check(tmp_path, {"backends": PINNED, "deployments": [
        {"name": "llama", "model": MODEL}, {"name": "sql", "model": MODEL, "adapter": "sql-lora", "parent": "sql"}]},
        capsys)
    assert code == 2 and "deployments[1].parent: must name a deployment without an adapter" in out
