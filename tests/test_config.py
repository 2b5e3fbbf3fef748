"""Configuration from explicit settings, SHMKV_* variables and YAML."""

from __future__ import annotations

import pytest

from shmkv.config import load_config
from shmkv.config_values import parse_size
from shmkv.errors import ConfigError


def test_defaults(tmp_path):
    cfg = load_config({}, env={})
    assert cfg.chunk_size == 256 and cfg.store_tail and cfg.load_failure_policy == "recompute"
    assert cfg.capacity == 0, "no explicit capacity: the existing segment's size, else default_capacity()"
    assert cfg.lock_timeout == 0.3
    assert cfg.cache_name.startswith("shmkv-")


def test_precedence_explicit_over_env_over_file(tmp_path):
    f = tmp_path / "shmkv.yaml"
    f.write_text("capacity: 1GiB\nchunk_size: 512\ncache_name: from-file\n")
    env = {"SHMKV_CONFIG_FILE": str(f), "SHMKV_CHUNK_SIZE": "128", "SHMKV_CAPACITY": "2GiB"}
    cfg = load_config({"capacity": "3GiB"}, env=env)
    assert cfg.capacity == 3 << 30 and cfg.chunk_size == 128 and cfg.cache_name == "from-file"


@pytest.mark.parametrize("text,n", [("8GiB", 8 << 30), ("512 MiB", 512 << 20), ("2g", 2 << 30),
                                    ("1000000", 10**6), (4096, 4096), ("1.5GiB", 3 << 29)])
def test_sizes(text, n):
    assert parse_size("capacity", text) == n


@pytest.mark.parametrize("key,value,accepted", [
    ("capacity", "lots", "byte size"),
    ("capacity", -1, "positive"),
    ("chunk_size", "x", "integer in [16"),
    ("store_tail", "maybe", "true or false"),
    ("load_failure_policy", "retry", "recompute, fail"),
    ("lossy_form", "int4", "fp8"),
    ("cuda_store_copy", "memcpy", "dma, kernel"),
    ("cuda_load_copy", "fast", "kernel, dma"),
    ("cache_name", "a/b", "A-Za-z0-9"),
])
def test_bad_values_name_key_value_and_what_is_accepted(key, value, accepted):
    with pytest.raises(ConfigError) as e:
        load_config({key: value}, env={})
    msg = str(e.value)
    assert key in msg and repr(value) in msg and accepted in msg


def test_unknown_keys_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="capacty"):
        load_config({"capacty": "1GiB"}, env={})
    f = tmp_path / "bad.yaml"
    f.write_text("nonsense: 1\n")
    with pytest.raises(ConfigError, match="nonsense"):
        load_config({"config_file": str(f)}, env={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config({"config_file": str(tmp_path / "missing.yaml")}, env={})


def test_a_misspelt_or_retired_setting_is_told_what_it_should_be(tmp_path):
    with pytest.raises(ConfigError, match=r"'capacty' is not a setting \(did you mean 'capacity'\?\)"):
        load_config({"capacty": "1GiB"}, env={})
    f = tmp_path / "old.yaml"
    f.write_text("debug_worker_off: why\n")
    with pytest.raises(ConfigError, match=r"'debug_worker_off' is retired: .*SHMKV_TEST_WORKER_OFF"):
        load_config({"config_file": str(f)}, env={})


@pytest.mark.parametrize("listen", ["0.0.0.0:7470", "[::]:7470", "192.0.2.1:7470", "10.1.2.3:80", "7470",
                                    "unix:relative.sock", "127.0.0.1:70000", "localhost:"])
def test_controller_listens_on_loopback_or_a_unix_socket_only(listen):
    """Loopback is reachable by every local user: on a shared host the unix
    socket (0600) is the private choice (README)."""
    with pytest.raises(ConfigError, match="listen="):
        load_config({"listen": listen})


@pytest.mark.parametrize("listen", ["127.0.0.1:7470", "localhost:0", "[::1]:7470", "unix:/run/shmkv.sock"])
def test_accepted_controller_addresses(listen):
    assert load_config({"listen": listen}).listen == listen
