"""Device strings, memory sizes and discovery."""
from __future__ import annotations

import dataclasses
import pickle

import pytest

from torchplace.devices import (
    Cluster,
    Device,
    Link,
    make_cluster,
    parse_bandwidth,
    parse_memory,
    parse_seconds,
)


@pytest.mark.parametrize(
    "text, nbytes",
    [(1024, 1024), ("20GiB", 20 * 2**30), ("512MB", 512 * 10**6), ("1.5 GB", 1_500_000_000), ("7", 7), ("3kib", 3072),
     ("8Gb", 8 * 10**9 // 8), ("64kb", 64 * 10**3 // 8), ("1e3MB", 10**9)],  # lower-case b: bits, as accelerate reads
)
def test_parse_memory(text, nbytes):
    assert parse_memory(text) == nbytes


@pytest.mark.parametrize("bad", ["lots", "12 parsecs", "-3GB", -1, "8b"])
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


@pytest.mark.parametrize("text, bps", [(5, 5.0), ("25GB/s", 25e9), ("100 MiB/s", 100 * 2**20), (1.5e9, 1.5e9)])
def test_parse_bandwidth(text, bps):
    assert parse_bandwidth(text) == bps


@pytest.mark.parametrize("text, bps", [("100Gb/s", 12.5e9), ("10 Mb/s", 1.25e6), ("8b/s", 1.0), ("1 kb/s", 125.0)])
def test_parse_bandwidth_lower_case_b_is_bits(text, bps):
    assert parse_bandwidth(text) == bps  # a 100 Gb/s network link moves 12.5 GB/s, not 100


@pytest.mark.parametrize("bad", ["10 Gbit/s", "5.GB/s"])
def test_an_unreadable_bandwidth_is_named_as_written(bad):
    with pytest.raises(ValueError, match=rf"cannot read bandwidth '{bad}'.*'10Gb/s' \(a lower-case b is bits"):
        parse_bandwidth(bad)  # was named without its '/s' ('10 Gbit'), and bits were not mentioned


@pytest.mark.parametrize("bad", [0, -1, "25GB", "fast/s", True, float("nan")])
def test_parse_bandwidth_rejects(bad):
    with pytest.raises(ValueError):
        parse_bandwidth(bad)


@pytest.mark.parametrize("text, s", [(0, 0.0), ("20us", 2e-5), ("3ms", 3e-3), ("0.5 s", 0.5), ("7ns", 7e-9), (1e-5, 1e-5)])
def test_parse_seconds(text, s):
    assert parse_seconds(text) == s


@pytest.mark.parametrize("bad", [-1, "5 minutes", "-3ms", float("inf"), None])
def test_parse_seconds_rejects(bad):
    with pytest.raises(ValueError):
        parse_seconds(bad)


def _two() -> tuple[Device, ...]:
    return (Device("a", "meta", "accel"), Device("b", "meta", "accel"))


def test_cluster_keeps_the_old_constructor_and_pair_bandwidth():
    c = Cluster(_two(), bandwidth=10.0, latency=1.0, pair_bandwidth={("a", "b"): 5.0})
    assert c.link_time(10, "a", "b") == 1.0 + 2.0
    assert c.link_time(10, "b", "a") == 1.0 + 1.0
    assert c.transfer_time(10) == 2.0 and c.topology == "mesh" and c.links == {}
    assert c.link("a", "b") == Link(5.0, 1.0)


def test_cluster_copies_keep_their_routes():
    c = Cluster(_two(), topology="graph", links={("a", "b"): Link(2.0, 0.5), ("b", "a"): Link(4.0, 0.5)})
    assert pickle.loads(pickle.dumps(c)).link("b", "a") == Link(4.0, 0.5)
    d = dataclasses.replace(c, links={("a", "b"): Link(8.0, 0.5), ("b", "a"): Link(4.0, 0.5)})
    assert d.link("a", "b") == Link(8.0, 0.5) and c.link("a", "b") == Link(2.0, 0.5)
    assert d != c and pickle.loads(pickle.dumps(c)) == c


def test_cluster_rejects_bad_defaults_and_topology():
    with pytest.raises(ValueError, match="topology"):
        Cluster(_two(), topology="ring")
    with pytest.raises(ValueError, match="bandwidth"):
        Cluster(_two(), bandwidth=0)
    with pytest.raises(ValueError, match="time"):
        Cluster(_two(), latency=-1e-6)


def test_link_of_unknown_device_is_a_key_error():
    with pytest.raises(KeyError, match="no device named 'z'"):
        Cluster(_two()).link_time(8, "a", "z")


def test_cluster_reads_bandwidth_and_latency_strings_into_numbers():
    c = Cluster(_two(), bandwidth="25GB/s", latency="5us")
    assert (c.bandwidth, c.latency) == (25e9, 5e-6)  # the string was kept: every transfer time then raised
    assert c.link_time(25_000, "a", "b") == c.transfer_time(25_000) == pytest.approx(6e-6, rel=1e-12)
    assert make_cluster(["cpu:0", "cpu:1"], bandwidth="100Gb/s", latency="2us").bandwidth == 12.5e9
