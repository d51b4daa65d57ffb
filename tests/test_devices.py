"""Device strings, memory sizes and discovery."""
from __future__ import annotations

import pytest

from torchplace.devices import make_cluster, parse_memory


@pytest.mark.parametrize(
    "text, nbytes",
    [(1024, 1024), ("20GiB", 20 * 2**30), ("512MB", 512 * 10**6), ("1.5 GB", 1_500_000_000), ("7", 7), ("3kib", 3072)],
)
def test_parse_memory(text, nbytes):
    assert parse_memory(text) == nbytes


@pytest.mark.parametrize("bad", ["lots", "12 parsecs", "-3GB", -1])
def test_parse_memory_rejects(bad):
    with pytest.raises(ValueError):
        parse_memory(bad)


def test_logical_cpus_are_separate_devices_on_the_cpu():
    c = make_cluster(["cpu:0", "cpu:1"], max_memory={"cpu:1": "1GiB"})
    assert [d.name for d in c.devices] == ["cpu:0", "cpu:1"]
    assert {d.torch_device for d in c.devices} == {"cpu"}
    assert c.devices[1].memory_bytes == 2**30
    assert not c.devices[0].pays_transfer


def test_unknown_device_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown device 'tpu:0'.*valid devices.*'cpu'"):
        make_cluster(["tpu:0"])


def test_max_memory_for_unknown_device():
    with pytest.raises(ValueError, match="not one of the devices"):
        make_cluster(["cpu:0"], max_memory={"cuda:3": "1GiB"})


def test_duplicate_device():
    with pytest.raises(ValueError, match="unique"):
        make_cluster(["cpu:0", "cpu:0"])
