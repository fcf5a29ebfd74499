import pytest
import yaml

from hybridpar.cluster import load_cluster

ALPHA, BW, GAMMA = 1e-5, 1e9, 1e-10  # intra-node hop: latency, bandwidth; reduction seconds per byte
NET_ALPHA, NET_BW = 5e-5, 2e8


@pytest.fixture
def flat_cluster(tmp_path):
    """Homogeneous test cluster: `gpus_per_node` devices on a full-bisection switch, one NIC per device
    (or `nics`), no base latency, so every collective must equal its textbook closed form."""

    def make(gpus: int, gpus_per_node: int = 8, nics: int | None = None):
        data = {"name": "flat", "gpus_per_node": gpus_per_node, "gamma_s_per_byte": GAMMA,
                "device": {"name": "d", "peak_flops": {"fp32": 1e12}, "mem_bw_Bps": 1e11, "memory_bytes": 1e10},
                "intra": {"kind": "switch", "link_name": "sw", "link_bw_Bps": BW, "link_latency_s": ALPHA,
                          "links_per_device": 1},
                "inter": {"name": "net", "nics_per_node": nics or gpus_per_node, "nic_bw_Bps": NET_BW,
                          "latency_s": NET_ALPHA}}
        path = tmp_path / f"flat{gpus}_{gpus_per_node}_{nics}.yaml"
        path.write_text(yaml.safe_dump(data))
        return load_cluster(str(path), gpus=gpus)

    return make
