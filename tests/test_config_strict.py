"""Settings that someone else could have chosen, or that a typo would turn
into a default, are refused or named: a config file others can write, a
non-integer for an integer setting, a size that is not whole bytes, a NUL
in `listen`, a space or newline inside `remote_url`, a relative path, a
setting given twice in the config file, a misspelled SHMKV_*
variable (one warning naming the closest setting)."""

from __future__ import annotations

import logging
import os

import pytest
from helpers import AS_ANOTHER_USER

from shmkv import config as config_module
from shmkv.config import load_config
from shmkv.errors import ConfigError


@pytest.mark.parametrize("mode", [0o666, 0o664, 0o646])
def test_a_config_file_others_can_write_is_refused(tmp_path, mode):
    f = tmp_path / "shmkv.yaml"
    f.write_text("remote_url: redis://evil.example:6379\n")
    os.chmod(f, mode)
    with pytest.raises(ConfigError) as e:
        load_config({"config_file": str(f)}, env={})
    msg = str(e.value)
    assert str(f) in msg and f"mode {mode:04o}" in msg and "chmod go-w" in msg


def test_an_own_private_config_file_is_accepted(tmp_path):
    f = tmp_path / "shmkv.yaml"
    f.write_text("chunk_size: 128\n")
    os.chmod(f, 0o600)
    assert load_config({"config_file": str(f)}, env={}).chunk_size == 128
    os.chmod(f, 0o644)  # readable by others is fine: only who can write it matters
    assert load_config({"config_file": str(f)}, env={}).chunk_size == 128


@AS_ANOTHER_USER
def test_a_config_file_owned_by_another_user_is_refused(tmp_path):
    f = tmp_path / "shmkv.yaml"
    f.write_text("chunk_size: 128\n")
    os.chmod(f, 0o644)
    os.chown(f, 65534, 65534)
    with pytest.raises(ConfigError, match=r"owned by uid 65534.*not by us"):
        load_config({"config_file": str(f)}, env={})


@pytest.mark.parametrize("key,value", [("chunk_size", 32.7), ("chunk_size", "32.7"), ("chunk_size", True),
                                       ("disk_level", "3x"), ("io_threads", 2.0), ("remote_ttl", "1e3")])
def test_integer_settings_refuse_anything_but_integers(key, value):
    with pytest.raises(ConfigError, match=f"{key}=.*expected an integer"):
        load_config({key: value}, env={})


def test_integer_settings_accept_integers_and_their_strings():
    cfg = load_config({"chunk_size": "128", "disk_level": 3, "io_threads": " 2 "}, env={})
    assert (cfg.chunk_size, cfg.disk_level, cfg.io_threads) == (128, 3, 2)


def test_a_nul_in_listen_is_a_config_error():
    with pytest.raises(ConfigError, match="NUL"):
        load_config({"listen": "unix:/tmp/a\x00b"}, env={})


def test_a_misspelled_variable_is_named_once(caplog, monkeypatch):
    monkeypatch.setattr(config_module, "_warned_env", set())
    env = {"SHMKV_CAPACTY": "8GiB", "SHMKV_CACHE_NAME": "x", "SHMKV_RUNTIME_DIR": "/tmp", "SHMKV_SEGMENT_DIR": "/run/x"}
    with caplog.at_level(logging.WARNING, logger="shmkv.config"):
        load_config({}, env=env)
        load_config({}, env=env)
    lines = [r.getMessage() for r in caplog.records if "SHMKV_" in r.getMessage()]
    assert lines == ["shmkv: environment variable SHMKV_CAPACTY is not a shmkv setting (ignored); "
                     "did you mean SHMKV_CAPACITY?"], lines


def test_a_setting_given_twice_in_the_config_file_is_refused(tmp_path):
    f = tmp_path / "shmkv.yaml"
    f.write_text("capacity: 8GiB\nchunk_size: 128\ncapacity: 64MiB\n")
    os.chmod(f, 0o600)
    with pytest.raises(ConfigError, match=r"'capacity' is given twice \(lines 1 and 3\)"):
        load_config({"config_file": str(f)}, env={})


@pytest.mark.parametrize("value", [1.5, "1.5", "2.25b", "0.3"])
def test_a_size_that_is_not_whole_bytes_is_refused(value):
    with pytest.raises(ConfigError, match="capacity=.*not a whole number of bytes"):
        load_config({"capacity": value}, env={})
    assert load_config({"capacity": "1.5GiB"}, env={}).capacity == 3 << 29


@pytest.mark.parametrize("url", ["redis://h:6379\nset x", "redis://h:6379/0 ", "redis://h:6379\t", "redis://a b:1"])
def test_a_remote_url_with_a_newline_or_space_inside_is_refused(url):
    if url.strip() != url:  # surrounding white space is trimmed, as for every setting
        assert load_config({"remote_url": url}, env={}).remote_url == url.strip()
        return
    with pytest.raises(ConfigError, match="remote_url: .* at character"):
        load_config({"remote_url": url}, env={})


@pytest.mark.parametrize("key", ["disk_dir", "remote_secret_file", "controller_token_file"])
def test_a_relative_path_setting_is_refused(key, monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match=f"{key}='spill': expected an absolute path"):
        load_config({key: "spill"}, env={})
    monkeypatch.setenv("HOME", str(tmp_path))
    assert getattr(load_config({key: "~/spill"}, env={}), key) == str(tmp_path / "spill")
