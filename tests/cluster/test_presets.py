import pytest

from hybridpar.cluster import PRESETS, load_cluster, read_cluster_file
from hybridpar.cluster.loader import unsourced_figures
from hybridpar.errors import UserError

# nvidia-smi topo -m of a DGX-1V (github:rapidsai/ucx-py docs/source/ucx-debug.rst), as transcribed in
# /work/shared/reference/hardware.yaml: NVLink count per GPU pair.
DGX1_NVLINKS = [
    [0, 1, 1, 2, 2, 0, 0, 0],
    [1, 0, 2, 1, 0, 2, 0, 0],
    [1, 2, 0, 2, 0, 0, 1, 0],
    [2, 1, 2, 0, 0, 0, 0, 1],
    [2, 0, 0, 0, 0, 1, 1, 2],
    [0, 2, 0, 0, 1, 0, 2, 1],
    [0, 0, 1, 0, 1, 2, 0, 2],
    [0, 0, 0, 1, 2, 1, 2, 0],
]


def test_presets_present():
    assert {"dgx1-v100", "lassen", "dgx-a100", "dgx-h100", "localhost"} <= set(PRESETS)


@pytest.mark.parametrize("name", [p for p in PRESETS if p != "localhost"])
def test_every_published_figure_has_a_source(name):
    assert unsourced_figures(read_cluster_file(name)) == []
    c = load_cluster(name)
    for key in ("device.peak_flops.fp32", "device.mem_bw_Bps", "device.memory_bytes", "intra.link_bw_Bps",
                "inter.nic_bw_Bps", "inter.nics_per_node"):
        assert c.sources.get(key), key


def test_dgx1_real_cube_mesh():
    c = load_cluster("dgx1-v100")
    assert [[c.nvlinks(a, b) for b in range(8)] for a in range(8)] == DGX1_NVLINKS
    assert all(sum(row) == 6 for row in DGX1_NVLINKS)  # every V100 uses its six links
    # Two links carry twice one link; a pair without NVLink takes the slower host path.
    assert c.p2p_bw_Bps(0, 3) == pytest.approx(2 * c.p2p_bw_Bps(0, 1))
    assert c.p2p_bw_Bps(0, 5) < c.p2p_bw_Bps(0, 1)
    assert c.p2p_latency_s(0, 5) > c.p2p_latency_s(0, 1)
    assert c.link_matrix()[0][:5] == ["X", "NV1", "NV1", "NV2", "NV2"]
    assert c.link_matrix()[0][5] == "SYS"


def test_gpus_make_nodes_and_last_node_may_be_partial():
    c = load_cluster("dgx1-v100", gpus=12)
    assert (c.num_nodes, c.num_devices, c.gpus_per_node) == (2, 12, 8)
    assert c.node_of(7) == 0 and c.node_of(8) == 1 and c.local_of(11) == 3
    assert c.devices_of_node(1) == (8, 9, 10, 11)
    assert c.links_between(0, 9) == ("n0:nic0:tx", "n1:nic0:rx")
    assert c.p2p_bw_Bps(1, 9) == pytest.approx(12.5e9)
    # Separate directions of a link are separate ids (full duplex).
    assert c.links_between(0, 3) != c.links_between(3, 0)
    with pytest.raises(ValueError):
        c.node_of(12)


def test_lassen_uses_the_sourced_single_plane_network():
    c = load_cluster("lassen", gpus=16)
    assert c.num_nodes == 4 and c.inter.nics_per_node == 1
    assert "Single Plane" in c.sources["inter.nics_per_node"] and "dual-rail" in c.sources["inter.nics_per_node"]
    assert c.sources["intra.link_bw_Bps"]
    with pytest.raises(UserError, match="at most 788 nodes"):
        load_cluster("lassen", gpus=4 * 789)


def test_switch_presets_are_full_bisection():
    for name, links in (("dgx-a100", 12), ("dgx-h100", 18)):
        c = load_cluster(name, gpus=16)
        assert c.nvlinks(0, 7) == links
        assert c.p2p_bw_Bps(0, 7) == pytest.approx(c.p2p_bw_Bps(2, 5))
        assert c.device.peak("tf32") > c.device.peak("fp32")
    assert load_cluster("dgx1-v100").device.peak("tf32") == 15.7e12  # V100 has no TF32: fp32 rate


@pytest.mark.parametrize("gpus", [0, -1, -8])
def test_bad_gpu_count(gpus):
    with pytest.raises(UserError, match="gpus must be >= 1"):
        load_cluster("dgx1-v100", gpus=gpus)


def test_unknown_preset_names_the_choices():
    with pytest.raises(UserError, match="unknown cluster 'dgx9'.*dgx1-v100"):
        load_cluster("dgx9")
