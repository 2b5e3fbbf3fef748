"""Credentials never leave in a URL shown to anyone (logs, `/health`, which
every uid may read): the userinfo's password and every credential-bearing
query parameter redis-py takes are redacted; the rest stays readable."""

from __future__ import annotations

import pytest

from shmkv.config_values import redact_url


@pytest.mark.parametrize("url, shown", [
    ("redis://alice:hunter2@cache:6379/0", "redis://alice:***@cache:6379/0"),
    ("rediss://cache:6380/0?ssl_password=hunter2&ssl_cert_reqs=required",
     "rediss://cache:6380/0?ssl_password=***&ssl_cert_reqs=required"),
    ("rediss://cache:6380/0?ssl_keyfile_password=hunter2", "rediss://cache:6380/0?ssl_keyfile_password=***"),
    ("redis://cache:6379/0?password=hunter2", "redis://cache:6379/0?password=***"),
    ("redis://cache:6379/0?Auth_Token=hunter2&db=1", "redis://cache:6379/0?Auth_Token=***&db=1"),
    ("redis://cache:6379/0", "redis://cache:6379/0"),
])
def test_no_credential_is_shown(url, shown):
    assert redact_url(url) == shown
    assert "hunter2" not in redact_url(url)


def test_each_url_of_a_cluster_seed_list_is_redacted():
    shown = redact_url("redis://u:pw1@a:1,redis://u:pw2@b:2,rediss://c:3?ssl_password=pw3")
    assert shown == "redis://u:***@a:1,redis://u:***@b:2,rediss://c:3?ssl_password=***"
