"""The memory budget's default and byte counts."""

from __future__ import annotations

import pytest

from metrale.manager.budget import default_max_resident_bytes, mem_total_bytes, parse_bytes, resident_estimate


def test_default_is_three_quarters_of_memtotal_minus_a_gib(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16777216 kB\nMemFree:         1000 kB\n")
    assert mem_total_bytes(meminfo) == 16 << 30
    assert default_max_resident_bytes(meminfo) == (12 << 30) - (1 << 30)
    meminfo.write_text("MemTotal:       1048576 kB\n")  # 1 GiB machine: the floor
    assert default_max_resident_bytes(meminfo) == 1 << 30
    with pytest.raises(ValueError, match="--max-resident-bytes"):
        default_max_resident_bytes(tmp_path / "missing")


@pytest.mark.parametrize(("text", "count"), [("123", 123), ("512M", 512 << 20), ("8G", 8 << 30), ("1.5GiB", 3 << 29),
                                             ("2gb", 2 << 30), ("64k", 64 << 10)])
def test_byte_counts(text, count):
    assert parse_bytes(text) == count


@pytest.mark.parametrize("text", ["", "G", "-1G", "0", "lots", "inf", "nan", "2P"])
def test_bad_byte_counts(text):
    with pytest.raises(ValueError, match="byte count"):
        parse_bytes(text)


def test_a_model_is_counted_at_its_weights_plus_its_kv_pool():
    assert resident_estimate(100, 28) == 128
