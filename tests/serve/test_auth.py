"""The API key covers every route but /health (and /metrics only when the operator says so);
several keys, and a key file that is re-read when it changes (rotation without a restart)."""

import httpx
import pytest

from autodeploy.serve import guards
from autodeploy.serve.guards import APIKeys
from conftest import serving

BODIES = {
    "/v1/completions": {"prompt": "x", "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
    "/tokenize": {"prompt": "x"},
    "/detokenize": {"tokens": [5]},
}


def _routes(app) -> list[tuple[str, str]]:
    routes = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", ()) or ()):
            if method != "HEAD":  # (a path parameter: the served model's name)
                routes.append((method, route.path.replace("{model_id:path}", "tiny")))
    return routes


def _call(url, method, path, **kwargs):
    return httpx.request(method, url + path, json=BODIES.get(path), timeout=60, **kwargs)


def test_every_route_but_health_needs_the_key(compiled, tokenizer):
    with serving(compiled, tokenizer, api_key=["first", "second"]) as server:
        app = server.server.config.app
        routes = _routes(app)
        assert {p for _, p in routes} >= {"/openapi.json", "/metrics", "/tokenize", "/detokenize", "/tokenizer_info",
                                          "/version", "/v1/models", "/v1/models/tiny", "/v1/completions", "/v1/chat/completions", "/health"}
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic first"}):
                response = _call(server.url, method, path, headers=headers)
                if path == "/health":
                    assert response.status_code == 200
                    continue
                assert response.status_code == 401, (method, path)
                assert response.json()["error"]["type"] == "AuthenticationError"
                assert response.headers["www-authenticate"] == "Bearer"
            for key in ("first", "second"):
                response = _call(server.url, method, path, headers={"Authorization": f"Bearer {key}"})
                assert response.status_code == 200, (method, path, response.text)
        assert httpx.get(server.url + "/nowhere").status_code == 401  # unknown paths too


def test_metrics_without_key_opens_only_metrics(compiled, tokenizer):
    with serving(compiled, tokenizer, api_key="k", metrics_without_key=True) as server:
        assert httpx.get(server.url + "/metrics").status_code == 200
        assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401


def test_the_key_file_is_re_read_when_it_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(guards, "KEY_FILE_RECHECK_SECONDS", 0.0)
    key_file = tmp_path / "keys"
    key_file.write_text("# rotated monthly\nold-key\n\n  new-key  \n")
    keys = APIKeys("flag-key", key_file)
    assert all(keys.accepts(f"Bearer {k}".encode()) for k in ("flag-key", "old-key", "new-key"))
    assert keys.accepts(b"bearer new-key") and not keys.accepts(b"Bearer # rotated monthly")
    key_file.write_text("newer-key\n")
    assert keys.accepts(b"Bearer newer-key") and not keys.accepts(b"Bearer old-key")
    key_file.unlink()  # an unreadable file keeps the keys read before
    assert keys.accepts(b"Bearer newer-key")


def test_an_empty_key_file_refuses_everyone_and_a_missing_one_is_an_error(tmp_path):
    (tmp_path / "keys").write_text("\n# none yet\n")
    keys = APIKeys(None, tmp_path / "keys")
    assert keys.enabled and not keys.accepts(b"Bearer ") and not keys.accepts(b"Bearer x")
    with pytest.raises(ValueError, match="cannot read the API key file"):
        APIKeys(None, tmp_path / "missing")


def test_serve_flags_for_keys(capsys, tmp_path):
    from autodeploy.cli import main
    import yaml

    (tmp_path / "keys").write_text("k\n")
    argv = ["serve", "ckpt", "--print_config", "--api_key", "a", "--api-key", "b", "--api_key_file",
            str(tmp_path / "keys"), "--metrics_without_key", "--drain_timeout", "3", "--max_stop_strings", "4",
            "--trust_request_chat_template"]
    assert main(argv) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["api_key"] == ["***", "***"] and config["api_key_file"] == str(tmp_path / "keys")
    assert config["metrics_without_key"] is True and config["drain_timeout"] == 3
    assert config["limits"]["max_stop_strings"] == 4 and config["limits"]["trust_request_chat_template"] is True
