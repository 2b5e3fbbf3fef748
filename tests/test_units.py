"""One byte formatter for every message (shmkv.units)."""

import pytest

from shmkv.units import format_bytes


@pytest.mark.parametrize("n,text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
                                    (256 << 20, "256.0 MiB"), (int(5.9 * (1 << 30)), "5.9 GiB"),
                                    (3 << 40, "3.0 TiB"), (5 << 50, "5120.0 TiB")])
def test_binary_units(n, text):
    assert format_bytes(n) == text
