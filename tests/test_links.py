"""Per-pair links: multi-hop widest paths, cluster files, and the link microbenchmark fit."""
from __future__ import annotations

import json
import math
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchplace
from torchplace import costmodel
from torchplace.clusterfile import load_cluster
from torchplace.devices import DEFAULT_LINK_BANDWIDTH, Cluster, Device, Link
from torchplace.errors import WorkloadFormatError
from torchplace.graph import NodeRecord, OpGraph
from torchplace.plan import Stage
from torchplace.problem import Problem
from torchplace.profiling import links
from torchplace.profiling.links import (
    LinkFit,
    cluster_with_measured_links,
    fit_link,
    measure_links,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "clusters"


def _devices(names: str, kind: str = "accel") -> tuple[Device, ...]:
    return tuple(Device(n, "meta", kind) for n in names)


def _both_ways(links: dict[tuple[str, str], Link]) -> dict[tuple[str, str], Link]:
    return {**links, **{(d, s): link for (s, d), link in links.items()}}


def _line() -> Cluster:
    """A - B - C - D; forward links fast (8, 2, 4 B/s, 0.25 s), backward ones 1 B/s, 0.5 s."""
    fwd = {("A", "B"): Link(8.0, 0.25), ("B", "C"): Link(2.0, 0.25), ("C", "D"): Link(4.0, 0.25)}
    back = {(d, s): Link(1.0, 0.5) for s, d in fwd}
    return Cluster(_devices("ABCD"), links={**fwd, **back}, topology="graph")


# -- multi-hop routes (MOIRAI Sec. III-C) -------------------------------------------------------------
def test_line_multi_hop_takes_slowest_hop_and_sums_latencies() -> None:
    c = _line()
    assert c.path("A", "D") == ("A", "B", "C", "D")
    assert c.link("A", "D") == Link(2.0, 0.75)
    assert c.link_time(16, "A", "D") == 0.75 + 16 / 2  # 8.75
    assert c.link_time(16, "D", "A") == 1.5 + 16 / 1  # asymmetric: back over 1 B/s links
    assert c.link_time(16, "C", "D") == 0.25 + 4.0
    assert c.link("B", "D") == Link(2.0, 0.5)
    assert c.link_time(0, "A", "D") == 0.0 and c.link_time(16, "B", "B") == 0.0


def test_diamond_takes_widest_not_shortest_path() -> None:
    # S-A-T: bottleneck 2, latency 2; S-B-T: bottleneck 3, latency 4.
    c = Cluster(_devices("SABT"), topology="graph", links=_both_ways({
        ("S", "A"): Link(4.0, 1.0), ("A", "T"): Link(2.0, 1.0),
        ("S", "B"): Link(3.0, 2.0), ("B", "T"): Link(3.0, 2.0),
    }))
    assert c.path("S", "T") == ("S", "B", "T")
    assert c.link_time(24, "S", "T") == 4.0 + 24 / 3  # 12, where S-A-T would take 2 + 12 = 14
    assert c.path("T", "S") == ("T", "B", "S")


def test_equally_wide_paths_tie_to_least_latency() -> None:
    c = Cluster(_devices("SBCT"), topology="graph", links=_both_ways({
        ("S", "B"): Link(3.0, 2.0), ("B", "T"): Link(3.0, 2.0),
        ("S", "C"): Link(3.0, 0.5), ("C", "T"): Link(5.0, 0.5),
    }))
    assert c.path("S", "T") == ("S", "C", "T")
    assert c.link("S", "T") == Link(3.0, 1.0)


def test_direct_link_is_used_even_when_a_detour_is_wider() -> None:
    c = Cluster(_devices("ABC"), topology="graph", links=_both_ways({
        ("A", "B"): Link(10.0, 0.1), ("B", "C"): Link(10.0, 0.1), ("A", "C"): Link(1.0, 0.1),
    }))
    assert c.path("A", "C") == ("A", "C") and c.link("A", "C") == Link(1.0, 0.1)


def test_link_defaults_fill_missing_bandwidth_and_latency() -> None:
    c = Cluster(_devices("ABC"), bandwidth=2.0, latency=0.5, topology="graph",
                links=_both_ways({("A", "B"): Link(), ("B", "C"): Link(latency=1.0)}))
    assert c.link("A", "C") == Link(2.0, 1.5)
    assert c.has_explicit_link("A", "C")


def test_mesh_uses_default_for_unlisted_pairs() -> None:
    c = Cluster(_devices("ABC"), bandwidth=4.0, latency=1.0, links={("A", "B"): Link(2.0, 0.5)})
    assert c.link_time(8, "A", "B") == 0.5 + 4.0
    assert c.link_time(8, "B", "A") == 1.0 + 2.0  # no reverse entry: default, not the A->B link
    assert c.path("A", "C") == ("A", "C")
    assert c.has_explicit_link("A", "B") and not c.has_explicit_link("A", "C")


def test_disconnected_graph_names_the_pair() -> None:
    with pytest.raises(ValueError, match=r"no path from device 'C' to 'A'"):
        Cluster(_devices("ABC"), topology="graph", links={**_both_ways({("A", "B"): Link(1.0)}), ("B", "C"): Link(1.0)})


@pytest.mark.parametrize(
    "links, match",
    [
        ({("A", "Z"): Link(1.0)}, "pair of device names"),
        ({("A", "A"): Link(1.0)}, "to itself"),
        ({("A", "B"): Link(0.0)}, "bandwidth must be a positive"),
        ({("A", "B"): Link(1.0, -1.0)}, "non-negative"),
        ({("A", "B"): (1.0, 2.0)}, "must be a Link"),
    ],
)
def test_bad_links_are_rejected(links, match) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        Cluster(_devices("AB"), links=links)


def test_pair_in_both_pair_bandwidth_and_links_is_rejected() -> None:
    with pytest.raises(ValueError, match="both pair_bandwidth and links"):
        Cluster(_devices("AB"), pair_bandwidth={("A", "B"): 1.0}, links={("A", "B"): Link(2.0)})


def test_problem_link_time_and_simulation_use_the_route() -> None:
    g = OpGraph()
    g.add_node("x", NodeRecord("x", times={"accel": 1.0}, output_bytes=16))
    g.add_node("y", NodeRecord("y", times={"accel": 1.0}))
    g.add_edge("x", "y")
    p = Problem(g, _line(), objective="latency")
    a, d = p.cluster.device("A"), p.cluster.device("D")
    assert p.link_time("x", a, d) == 8.75
    assert costmodel.simulate(p, [Stage("A", ("x",)), Stage("D", ("y",))]).makespan == 1.0 + 8.75 + 1.0


# -- cluster files ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_round_trip_through_a_file(tmp_path: Path, fmt: str) -> None:
    if fmt == "yaml":
        pytest.importorskip("yaml")
    devices = (Device("gpu", "cuda:0", "cuda", 2**34), Device("slow", "meta", "t4", None), Device("cpu", "cpu", "cpu", 7))
    c = Cluster(devices, bandwidth=3e9, latency=2e-5, topology="graph", links={
        ("cpu", "gpu"): Link(25e9, 8e-6), ("gpu", "cpu"): Link(22e9, 8e-6),
        ("cpu", "slow"): Link(6e9), ("slow", "cpu"): Link(6e9), ("gpu", "slow"): Link(latency=1e-4),
        ("slow", "gpu"): Link(latency=1e-4),
    })
    c.save(tmp_path / f"c.{fmt}")
    back = load_cluster(tmp_path / f"c.{fmt}")
    assert back == c
    assert {(s, d): back.link(s, d) for s in c.names for d in c.names} == {
        (s, d): c.link(s, d) for s in c.names for d in c.names}


def test_threads_round_trip_through_a_file(tmp_path: Path) -> None:
    c = Cluster((Device("cpu:0", "cpu", "cpu", threads=2), Device("cpu:1", "cpu", "cpu")))
    c.save(tmp_path / "c.json")
    assert load_cluster(tmp_path / "c.json") == c  # threads were dropped: the reloaded CPUs took every core


def test_pair_bandwidth_round_trips_as_links_with_the_same_routes(tmp_path: Path) -> None:
    c = Cluster(_devices("AB"), bandwidth=4.0, latency=1.0, pair_bandwidth={("A", "B"): 2.0})
    c.save(tmp_path / "c.json")
    back = load_cluster(tmp_path / "c.json")
    assert back.links == {("A", "B"): Link(2.0)}
    assert [back.link_time(8, s, d) for s, d in ("AB", "BA")] == [c.link_time(8, s, d) for s, d in ("AB", "BA")]


def test_bidirectional_entry_is_written_once() -> None:
    c = Cluster(_devices("AB"), links=_both_ways({("A", "B"): Link(2.0, 1.0)}))
    assert c.to_json()["links"] == [{"src": "A", "dst": "B", "bandwidth": 2.0, "latency": 1.0, "bidirectional": True}]


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    return path


_OK = {"devices": [{"name": "a", "kind": "cuda"}, {"name": "b", "kind": "cpu"}]}


@pytest.mark.parametrize(
    "data, field",
    [
        ([], "top level"),
        ({"devices": []}, "devices"),
        ({**_OK, "bandwith": 1e9}, "unknown field 'bandwith'"),
        ({**_OK, "format": "x/2"}, "format"),
        ({"devices": [{"kind": "cuda"}]}, r"devices\[0\]: missing field 'name'"),
        ({"devices": [{"name": "a"}]}, r"devices\[0\]: missing field 'kind'"),
        ({"devices": [{"name": None, "kind": "x"}]}, r"devices\[0\]\.name"),
        ({"devices": [{"name": "a", "kind": "cuda", "memory": "lots"}]}, r"devices\[0\]\.memory"),
        ({"devices": [{"name": "a", "kind": "x"}, {"name": "a", "kind": "y"}]}, "used twice"),
        ({**_OK, "bandwidth": -1}, r"top level\.bandwidth"),
        ({**_OK, "latency": "3 fortnights"}, r"top level\.latency"),
        ({**_OK, "topology": "ring"}, "topology"),
        ({**_OK, "links": {"src": "a"}}, "links: expected a list"),
        ({**_OK, "links": [{"src": "a"}]}, r"links\[0\]: missing field 'dst'"),
        ({**_OK, "links": [{"src": "a", "dst": "z"}]}, r"links\[0\]\.dst: 'z' is not a device"),
        ({**_OK, "links": [{"src": "a", "dst": "a"}]}, r"links\[0\]: src and dst"),
        ({**_OK, "links": [{"src": "a", "dst": "b", "bandwidth": "fast"}]}, r"links\[0\]\.bandwidth"),
        ({**_OK, "links": [{"src": "a", "dst": "b", "bidirectional": "yes"}]}, r"links\[0\]\.bidirectional"),
        ({**_OK, "links": [{"src": "a", "dst": "b"}, {"src": "b", "dst": "a"}]}, r"links\[1\].*links\[0\]"),
        ({**_OK, "topology": "graph", "links": [{"src": "a", "dst": "b", "bidirectional": False}]},
         "links: no path from device 'b' to 'a'"),
    ],
)
def test_malformed_file_names_the_field_and_the_file(tmp_path: Path, data: object, field: str) -> None:
    path = _write(tmp_path, data)
    with pytest.raises(WorkloadFormatError, match=field) as info:
        load_cluster(path)
    assert str(info.value).count(str(path)) == 1  # named once, and a top-level field not as "links: FILE: ..."
    assert ": links: " not in str(info.value) or "links" in field


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(WorkloadFormatError, match="cannot read cluster file"):
        load_cluster(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(WorkloadFormatError, match=r"x\.json: not valid JSON"):
        load_cluster(tmp_path / "x.json")


def test_file_defaults_and_units(tmp_path: Path) -> None:
    path = _write(tmp_path, {"bandwidth": "2GB/s", "latency": "5us", "devices": [
        {"name": "a", "kind": "cuda", "memory": "16GiB"}, {"name": "b", "kind": "cpu", "torch_device": "cpu"}],
        "links": [{"src": "a", "dst": "b", "latency": "1ms"}]})
    c = load_cluster(path)
    assert c.devices[0] == Device("a", "meta", "cuda", 16 * 2**30)
    assert (c.bandwidth, c.latency, c.topology) == (2e9, 5e-6, "mesh")
    assert c.link("b", "a") == Link(2e9, 1e-3)  # bidirectional by default, bandwidth from the top level


def test_example_two_gpus_and_cpu() -> None:
    c = load_cluster(EXAMPLES / "two-gpus-and-cpu.json")
    assert c.names == ["cuda:0", "cuda:1", "cpu"]
    assert c.link("cpu", "cuda:0") != c.link("cuda:0", "cpu")  # asymmetric PCIe
    assert c.link_time(25 * 10**9, "cpu", "cuda:0") == pytest.approx(1.0 + 8e-6)
    assert c.link("cuda:0", "cuda:1") == c.link("cuda:1", "cuda:0")


def test_example_two_hosts_prices_the_network_between_them() -> None:
    c = load_cluster(EXAMPLES / "two-hosts.json")
    g = OpGraph()
    g.add_node("x", NodeRecord("x", times={"cpu": 1.0}, output_bytes=1_250_000))
    g.add_node("y", NodeRecord("y", times={"cpu": 1.0}))
    g.add_edge("x", "y")
    p = Problem(g, c, objective="latency")
    # two CPU-kind hosts pay only over a listed link: with the default link alone this was 0 s
    assert p.link_time("x", c.device("host0"), c.device("host1")) == pytest.approx(50e-6 + 1e-3)
    assert costmodel.simulate(p, [Stage("host0", ("x",)), Stage("host1", ("y",))]).makespan == pytest.approx(2.00105)


def test_example_edge_devices_is_a_multi_hop_line() -> None:
    c = load_cluster(EXAMPLES / "edge-devices.json")
    assert c.topology == "graph" and {d.torch_device for d in c.devices} == {"meta"}
    assert c.path("camera-pi", "edge-server") == ("camera-pi", "jetson-nano", "jetson-orin", "edge-server")
    assert c.link("camera-pi", "edge-server") == Link(5e6, pytest.approx(3e-3 + 200e-6 + 50e-6))
    assert c.link("edge-server", "camera-pi").bandwidth == 12.5e6  # the Wi-Fi downlink


# -- link microbenchmark fit (Baechi Sec. 4.1) -------------------------------------------------------
def test_fit_recovers_an_exact_line() -> None:
    sizes = [2**k for k in range(10, 27, 2)]
    lat, bw = 7e-6, 11.5e9
    fit = fit_link(sizes, [lat + n / bw for n in sizes])
    assert fit.latency == pytest.approx(lat, rel=1e-9)
    assert fit.bandwidth == pytest.approx(bw, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0) and fit.samples == len(sizes)
    assert fit.time(2**20) == pytest.approx(lat + 2**20 / bw, rel=1e-12)


def test_fit_with_repeated_sizes_and_noise_is_least_squares() -> None:
    # points (1, 2), (1, 4), (3, 6), (3, 8): the line through the two means is 1 + 2 x, residuals +-1.
    fit = fit_link([1, 1, 3, 3], [2.0, 4.0, 6.0, 8.0])
    assert (fit.latency, fit.bandwidth) == (pytest.approx(1.0), pytest.approx(0.5))
    assert fit.r2 == pytest.approx(0.8)


def test_fit_clamps_and_rejects() -> None:
    assert fit_link([1, 2], [1.0, 0.5]).bandwidth == math.inf  # falling: no measurable bandwidth
    assert fit_link([1, 2], [-1.0, 1.0]).latency == 0.0
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_link([4, 4], [1.0, 2.0])
    with pytest.raises(ValueError, match="one length"):
        fit_link([1, 2], [1.0])


def test_measured_fits_replace_cluster_links() -> None:
    c = Cluster(_devices("AB"), pair_bandwidth={("A", "B"): 1.0, ("B", "A"): 1.0})
    fits = {("A", "B"): LinkFit(latency=1e-6, bandwidth=5e9, r2=0.99, samples=8)}
    new = cluster_with_measured_links(c, fits)
    assert new.link("A", "B") == Link(5e9, 1e-6)
    assert new.link("B", "A") == Link(1.0, c.latency)
    with pytest.raises(ValueError, match="not a device of the cluster"):
        cluster_with_measured_links(c, {("A", "Q"): fits[("A", "B")]})


@pytest.mark.filterwarnings("ignore:link .* poorly:RuntimeWarning")  # a busy machine may time noisily
def test_real_cpu_measurement_gives_positive_bandwidth() -> None:
    fits = measure_links(["cpu:0", "cpu:1"], sizes=(2**16, 2**18, 2**20, 2**22), repeats=10, warmup=1, progress=False)
    assert set(fits) == {("cpu:0", "cpu:1"), ("cpu:1", "cpu:0")}
    for fit in fits.values():
        assert fit.bandwidth > 0 and fit.latency >= 0 and fit.samples == 4
    c = cluster_with_measured_links(Cluster(_devices(["cpu:0", "cpu:1"], "cpu")), fits)
    assert c.link("cpu:0", "cpu:1").bandwidth == fits[("cpu:0", "cpu:1")].bandwidth


def test_measure_rejects_meta_and_unknown_devices() -> None:
    with pytest.raises(ValueError, match="meta"):
        measure_links(["cpu", "meta"], progress=False)
    with pytest.raises(ValueError, match="not a torch device"):
        measure_links(["cpu", "warp-drive:0"], progress=False)


# -- certificate: widest path equals brute force over all simple paths ---------------------------------
@st.composite
def _link_graphs(draw):
    names = [f"d{i}" for i in range(draw(st.integers(2, 5)))]
    pairs = [(s, d) for s in names for d in names if s != d]
    chosen = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=len(pairs)))
    if draw(st.integers(0, 3)):  # mostly strongly connected: a two-way chain plus random links
        chosen = sorted(set(chosen) | {p for a, b in pairwise(names) for p in ((a, b), (b, a))})
    links = {p: Link(float(draw(st.integers(1, 4))), float(draw(st.integers(0, 3)))) for p in chosen}
    return names, links


@settings(max_examples=60, deadline=None)
@given(_link_graphs())
def test_widest_path_matches_brute_force(case) -> None:
    import networkx as nx

    names, links = case
    g = nx.DiGraph(list(links))
    g.add_nodes_from(names)
    try:
        c = Cluster(_devices(names), topology="graph", links=links)
    except ValueError as e:
        assert any(not nx.has_path(g, s, d) for s in names for d in names if s != d), e
        return
    for s in names:
        for d in names:
            if s == d:
                continue
            if (s, d) in links:
                assert c.link(s, d) == links[(s, d)]
                continue
            best = max(
                (min(links[h].bandwidth for h in pairwise(p)), -sum(links[h].latency for h in pairwise(p)))
                for p in nx.all_simple_paths(g, s, d)
            )
            assert c.link(s, d) == Link(best[0], -best[1])
            hops = list(pairwise(c.path(s, d)))
            assert min(links[h].bandwidth for h in hops) == best[0] and sum(links[h].latency for h in hops) == -best[1]


def test_measure_links_fits_the_chosen_statistic_per_size(monkeypatch) -> None:
    from torchplace.profiling import links

    def fake(src, dst, sizes, repeats, warmup, allocate):  # the fastest copies lie on an exact line
        noise = {2**14: 1.0}  # ... the median ones do not
        return {n: [1e-6 + n / 4e9 + k * noise.get(n, 0.0) for k in (2, 0, 1)] for n in sizes}

    monkeypatch.setattr(links, "time_copies", fake)
    fits = measure_links(["cpu:0", "cpu:1", "cpu:2"], sizes=(2**10, 2**14, 2**20), repeats=3, progress=False)
    assert len(fits) == 6
    for fit in fits.values():
        assert (fit.latency, fit.bandwidth) == (pytest.approx(1e-6, rel=1e-9), pytest.approx(4e9, rel=1e-9))
    with pytest.warns(RuntimeWarning, match="poorly"):
        measure_links(["cpu:0", "cpu:1"], sizes=(2**10, 2**14, 2**20), repeats=3, statistic="median", progress=False)
    with pytest.raises(ValueError, match="statistic"):
        measure_links(["cpu:0", "cpu:1"], statistic="mean", progress=False)


def _fake_copies(monkeypatch, there: LinkFit, back: LinkFit) -> list[str]:
    """Pretend a CUDA device is attached whose copies to and from the host fit ``there`` / ``back``."""
    calls: list[str] = []

    def measure(device: str, repeats: int = 5) -> dict[tuple[str, str], LinkFit]:
        calls.append(device)
        return {("cpu", device): there, (device, "cpu"): back}

    monkeypatch.setattr(links, "measure_host_links", measure)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return calls


def test_host_links_are_fitted_both_ways() -> None:
    fits = links.measure_host_links("cpu:1", repeats=2)  # host memory to host memory: a memcpy
    assert set(fits) == {("cpu", "cpu:1"), ("cpu:1", "cpu")}
    assert all(f.bandwidth > 0 and f.samples == len(links.HOST_LINK_SIZES) for f in fits.values())


def test_host_links_are_measured_both_ways_and_priced_per_side(monkeypatch) -> None:
    # to the GPU 4 GB/s + 20 us, back 1 GB/s + 40 us (a fresh host buffer pays its page faults)
    calls = _fake_copies(monkeypatch, LinkFit(20e-6, 4e9, 1.0, 6), LinkFit(40e-6, 1e9, 1.0, 6))
    cluster = Cluster((Device("cuda:0", "cuda:0", "cuda"), Device("cpu:0", "cpu", "cpu"), Device("cpu:1", "cpu", "cpu")))
    out = links.with_measured_host_links(cluster)
    assert calls == ["cuda:0"]  # one host, however many logical CPUs
    for host in ("cpu:0", "cpu:1"):
        assert out.link(host, "cuda:0") == Link(4e9, 20e-6)
        assert out.link("cuda:0", host) == Link(1e9, 40e-6)
    # the per-side price of the throughput model: the mean of the two directions' times
    assert out.transfer_time(10**6) == pytest.approx((20e-6 + 10**6 / 4e9 + 40e-6 + 10**6 / 1e9) / 2)
    g = OpGraph()
    g.add_node("a", NodeRecord("a", output_bytes=10**6, times={"cpu": 1.0, "cuda": 1.0}))
    p = Problem(g, out, objective="latency")
    assert p.link_time("a", out.device("cuda:0"), out.device("cpu:1")) == pytest.approx(40e-6 + 1e-3)


def test_a_cluster_without_a_cuda_device_is_not_measured(monkeypatch) -> None:
    calls = _fake_copies(monkeypatch, LinkFit(0.0, 1e9, 1.0, 6), LinkFit(0.0, 1e9, 1.0, 6))
    cluster = Cluster((Device("cpu:0", "cpu", "cpu"), Device("cpu:1", "cpu", "cpu")))
    assert links.with_measured_host_links(cluster) is cluster
    assert calls == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_place_on_a_gpu_measures_its_host_link() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    placed = torchplace.place(model, ["cuda:0", "cpu"], torch.randn(16, 64), progress=False, repeats=1, warmup=0)
    up, down = placed.problem.cluster.link("cpu", "cuda:0"), placed.problem.cluster.link("cuda:0", "cpu")
    assert up.bandwidth != DEFAULT_LINK_BANDWIDTH and math.isfinite(up.bandwidth) and up.bandwidth > 1e8
    assert down.bandwidth != DEFAULT_LINK_BANDWIDTH and down.bandwidth > 1e7
