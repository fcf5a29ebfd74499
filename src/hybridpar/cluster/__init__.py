"""hybridpar.cluster: hardware as validated data (devices, links, topology, presets)."""

from hybridpar.cluster.loader import PRESETS, load_cluster, read_cluster_file
from hybridpar.cluster.model import Cluster, DeviceSpec, InterNode, IntraNode, Route

__all__ = ["PRESETS", "Cluster", "DeviceSpec", "InterNode", "IntraNode", "Route", "load_cluster",
           "read_cluster_file"]
