"""Issue 9, item 7: numbers and devices from a user are checked, never truncated or overflowed.

Each bad input gets the typed error the house rules name (UsageError for arguments,
WorkloadFormatError naming the file and the field for files); valid inputs read as before.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from torchplace import machine
from torchplace.checks import brief, check_float, non_negative_float, non_negative_int, positive_float, positive_int
from torchplace.clusterfile import load_cluster
from torchplace.devices import (
    Cluster,
    Device,
    check_attached,
    make_cluster,
    parse_bandwidth,
    parse_memory,
    parse_seconds,
)
from torchplace.errors import UsageError, WorkloadFormatError
from torchplace.units import parse_torch_device

HUGE = 10**400  # an integer beyond float range: float(HUGE) raises OverflowError


# -- checks ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("check", "value", "expected"), [
    (positive_int, 4, 4), (positive_int, 4.0, 4), (positive_int, np.int64(3), 3), (non_negative_int, 0, 0),
    (non_negative_int, 2**60, 2**60), (positive_float, 1e-300, 1e-300), (non_negative_float, 0, 0.0),
    (non_negative_float, np.float32(2.5), 2.5), (positive_float, 7, 7.0),
])
def test_checks_accept_and_convert(check, value, expected):
    out = check(value, "x")
    assert out == expected and type(out) is type(expected)


@pytest.mark.parametrize("check", [positive_int, non_negative_int, positive_float, non_negative_float])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, True, "3", None, HUGE, -HUGE, [1]])
def test_checks_reject_non_numbers_and_non_finite(check, bad):
    with pytest.raises(UsageError, match=r"^microbatches: expected a (positive|non-negative)"):
        check(bad, "microbatches")


@pytest.mark.parametrize(("check", "bad"), [
    (positive_int, 2.5), (positive_int, 0), (positive_int, -1), (non_negative_int, 1.7), (non_negative_int, -1),
    (positive_float, 0.0), (positive_float, -1e-9), (non_negative_float, -1),
])
def test_checks_reject_fractions_and_out_of_range(check, bad):
    with pytest.raises(UsageError, match=f"got {bad!r}$"):
        check(bad, "n")


def test_checks_raise_the_callers_error_type_with_the_field():
    with pytest.raises(WorkloadFormatError, match=r"^w\.json: nodes\[0\]\.size: expected a non-negative whole number of bytes, got 1\.7$"):
        non_negative_int(1.7, "w.json: nodes[0].size", unit="of bytes", error=WorkloadFormatError)
    with pytest.raises(ValueError):  # UsageError is a ValueError too
        check_float(math.nan, "time_limit")


def test_brief_keeps_messages_short_and_on_one_line():
    assert len(brief(HUGE)) < 80 and "401 digits" in brief(HUGE)
    assert "\n" not in brief("a\nb") and len(brief("x" * 1000)) <= 60
    with pytest.raises(UsageError) as e:
        positive_int(HUGE, "batch")
    assert "beyond float range" in str(e.value) and len(str(e.value)) < 150


# -- memory, bandwidth, time, device strings ----------------------------------------------------------
def test_memory_strings_convert_exactly():
    assert parse_memory("1.1GB") == 1_100_000_000  # 1.1 * 1e9 in floats is 1100000000.0000002
    assert parse_memory("0.3GiB") == 3 * 2**30 // 10  # a larger unit rounds down to whole bytes
    assert parse_memory(2.0**40) == 2**40 and parse_memory("7") == 7


@pytest.mark.parametrize("bad", [1.7, "1.5", "1.7B", math.inf, math.nan, HUGE, "9" * 500 + "GB", True, None])
def test_memory_must_be_whole_finite_bytes(bad):
    with pytest.raises(UsageError, match="memory|memory size"):
        parse_memory(bad)


@pytest.mark.parametrize("bad", [HUGE, math.nan, -math.inf, "1e400B/s", "9" * 400 + "GB/s"])
def test_bandwidth_rejects_overflow_and_nan(bad):
    with pytest.raises(UsageError, match="bandwidth"):
        parse_bandwidth(bad)


def test_infinite_bandwidth_is_a_latency_only_link():
    assert parse_bandwidth(math.inf) == math.inf  # what a fitted link with no measurable slope has


@pytest.mark.parametrize("bad", ["1e400", math.nan, HUGE, "nan"])
def test_seconds_reject_overflow_and_nan(bad):
    with pytest.raises(UsageError, match="time"):
        parse_seconds(bad)


DEVICE_STRINGS = ["cpu", "cuda", "cuda:0", "cuda:7", "cuda:127", "cuda:128", "cuda:255", "cuda:32768", "cuda:01",
                  "cuda:-1", " cuda:0", "CUDA:0", "cuda:", "cuda:0:1", "cuda:1e3", "potato", "meta", "mps", "xpu:3",
                  "hip:0", "privateuseone", "metal", "cpu:1", "", "cuda:+1", "a_b"]


@pytest.mark.parametrize("text", DEVICE_STRINGS)
def test_torch_device_syntax_agrees_with_torch(text):
    """Certificate: we accept exactly what torch.device parses to itself (torch silently wraps
    indices above 127: cuda:128 becomes cuda:-128, cuda:32768 becomes cuda:0; we refuse those)."""
    import torch

    try:
        dev = torch.device(text)
    except RuntimeError:
        dev = None
    try:
        ours = parse_torch_device(text)
    except UsageError:
        ours = None
    assert (ours is not None) == (dev is not None and str(dev) == text)
    if ours is not None:
        assert (dev.type, dev.index) == ours


# -- clusters and make_cluster ----------------------------------------------------------------------
@pytest.mark.parametrize(("device", "fragment"), [
    (Device("a", "potato", "x"), "device 'a': torch_device 'potato' is not a torch device"),
    (Device("a", "cuda:0", "x", 1.7), "device 'a': memory_bytes: expected a non-negative whole number"),
    (Device("a", "cuda:0", "x", -1), "memory_bytes"),
    (Device("a", "cuda:0", "x", math.inf), "memory_bytes"),
    (Device("", "cpu", "cpu"), "device name must be a non-empty string"),
    (Device("a", "cpu", ""), "device 'a': kind"),
])
def test_cluster_refuses_malformed_devices(device, fragment):
    with pytest.raises(UsageError, match=fragment):
        Cluster((device,))


def test_cluster_may_describe_gpus_that_are_not_attached():
    assert Cluster((Device("g", "cuda:7", "cuda", 2**34),)).devices[0].torch_device == "cuda:7"


@pytest.fixture
def two_gpus(monkeypatch):
    """This machine seen as one with two CUDA devices of 16 GiB."""
    monkeypatch.setattr(machine, "cuda_count", lambda: 2)
    monkeypatch.setattr(machine, "cuda_memory", lambda i: 16 * 2**30)


def test_make_cluster_takes_the_gpus_that_exist(two_gpus):
    c = make_cluster(["cuda:1", "cpu:0", Device("fast", "cuda:0", "cuda", 2**30)])
    assert [(d.name, d.torch_device, d.memory_bytes) for d in c.devices][::2] == [
        ("cuda:1", "cuda:1", 16 * 2**30), ("fast", "cuda:0", 2**30)]


@pytest.mark.parametrize(("spec", "fragment"), [
    ("cuda:7", r"unknown device 'cuda:7' \(not a device of this machine\).*'cuda:1'"),
    ("cuda:2", "unknown device 'cuda:2'"),
    ("potato", r"unknown device 'potato' \(not a torch device string\)"),
    (Device("x", "cuda:7", "cuda"), "device 'x': torch_device 'cuda:7' is not on this machine, which has 2 cuda devices"),
    (Device("x", "potato", "cuda"), "device 'x': torch_device 'potato' is not a torch device"),
    (Device("x", "meta", "accel"), "device 'x': torch_device 'meta' holds no data"),
    (Device("x", "xpu:0", "xpu"), "not on this machine"),
    (3, "a device must be a string"),
])
def test_make_cluster_refuses_devices_that_are_not_here(two_gpus, spec, fragment):
    with pytest.raises(UsageError, match=fragment):
        make_cluster(["cpu:0", spec])


def test_a_planning_cluster_is_checked_before_running_on_it(two_gpus, tmp_path):
    check_attached(Cluster((Device("g", "cuda:1", "cuda"), Device("c", "cpu", "cpu"))))
    path = tmp_path / "c.json"
    path.write_text('{"devices": [{"name": "c", "kind": "cpu", "torch_device": "cpu"}, '
                    '{"name": "g", "kind": "cuda", "torch_device": "cuda:7"}]}')
    with pytest.raises(UsageError, match="device 'g': torch_device 'cuda:7' is not on this machine, which has 2"):
        check_attached(load_cluster(path))


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"devices": "cpu"}, "devices must be a list"),
    ({"devices": []}, "at least one device"),
    ({"devices": ["cpu:0"], "max_memory": {"cpu:0": 1.5}}, r"max_memory\['cpu:0'\]: memory must be a non-negative whole"),
    ({"devices": ["cpu:0"], "max_memory": {"cpu:0": math.inf}}, r"max_memory\['cpu:0'\]"),
    ({"devices": ["cpu:0"], "max_memory": ["1GiB"]}, "max_memory must be a dict"),
    ({"devices": ["cpu:0"], "bandwidth": math.nan}, "bandwidth"),
    ({"devices": ["cpu:0"], "latency": HUGE}, "time"),
])
def test_make_cluster_refuses_bad_arguments(kwargs, fragment):
    with pytest.raises(UsageError, match=fragment):
        make_cluster(**kwargs)


# -- cluster files: syntax only ----------------------------------------------------------------------
def _cluster_file(tmp_path, device_fields="", top="", link=""):
    text = ('{"devices": [{"name": "a", "kind": "cuda"%s}, {"name": "b", "kind": "cpu", "torch_device": "cpu"}]%s'
            ', "links": [{"src": "a", "dst": "b"%s}]}') % (device_fields, top, link)
    path = tmp_path / "c.json"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("fields", "fragment"), [
    ({"device_fields": ', "torch_device": "potato"'}, r"devices\[0\]\.torch_device: 'potato' is not a torch device"),
    ({"device_fields": ', "torch_device": "cuda:128"'}, r"devices\[0\]\.torch_device"),
    ({"device_fields": ', "memory": 1.7'}, r"devices\[0\]\.memory: memory must be a non-negative whole number"),
    ({"device_fields": ', "memory": Infinity'}, r"devices\[0\]\.memory"),
    ({"device_fields": ', "memory": 1e400'}, r"devices\[0\]\.memory"),
    ({"device_fields": ', "memory": 1' + "0" * 400}, r"devices\[0\]\.memory"),
    ({"top": ', "latency": NaN'}, r"top level\.latency"),
    ({"top": ', "bandwidth": -Infinity'}, r"top level\.bandwidth"),
    ({"link": ', "latency": 1e400'}, r"links\[0\]\.latency"),
    ({"link": ', "bandwidth": 1' + "0" * 400}, r"links\[0\]\.bandwidth"),
])
def test_cluster_file_numbers_and_torch_devices(tmp_path, fields, fragment):
    path = _cluster_file(tmp_path, **fields)
    with pytest.raises(WorkloadFormatError, match=fragment) as e:
        load_cluster(path)
    assert str(path) in str(e.value)


def test_cluster_file_plans_for_hardware_not_attached(tmp_path):
    c = load_cluster(_cluster_file(tmp_path, device_fields=', "torch_device": "cuda:7"', link=', "bandwidth": Infinity'))
    assert c.device("a").torch_device == "cuda:7" and c.link("a", "b").bandwidth == math.inf


@pytest.mark.parametrize(("data", "fragment"), [
    ({"devices": [{"name": "a", "kind": "x"}], "links": [{"src": ["a"], "dst": "a"}]}, r"links\[0\]\.src: \['a'\] is not a device"),
    ({"devices": [{"name": "a", "kind": "x"}], 3: 1}, "unknown field"),
])
def test_cluster_file_odd_values_are_format_errors(tmp_path, data, fragment):
    path = tmp_path / "c.yaml"
    pytest.importorskip("yaml").safe_dump(data, path.open("w"))
    with pytest.raises(WorkloadFormatError, match=fragment):
        load_cluster(path)


def test_yaml_cluster_infinite_memory(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "c.yaml"
    path.write_text("devices:\n- {name: a, kind: x, memory: .inf}\n")
    with pytest.raises(WorkloadFormatError, match=r"devices\[0\]\.memory"):
        load_cluster(path)


def test_yaml_errors_are_one_line(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "c.yaml"
    path.write_text("devices: [\n  {name: a\n")
    with pytest.raises(WorkloadFormatError, match="not valid YAML") as e:
        load_cluster(path)
    assert "\n" not in str(e.value)


def test_json_helper_is_used_for_clusters(tmp_path):
    path = tmp_path / "c.json"
    Cluster((Device("a", "cpu", "cpu", 7),)).save(path)
    assert json.loads(path.read_text())["devices"][0]["memory"] == 7
