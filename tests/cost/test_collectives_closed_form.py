"""On a homogeneous network the topology-aware model must reduce to the textbook closed forms."""

import math

import pytest
from cost_flat_cluster import ALPHA, BW, GAMMA, NET_ALPHA, NET_BW

from hybridpar.cost import collectives as co

N = 1e7
BETA = 1 / BW


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_ring_forms(flat_cluster, p):
    c = flat_cluster(p)
    ranks = range(p)
    assert co.allreduce_time(N, ranks, c, "ring") == pytest.approx(
        2 * (p - 1) * ALPHA + 2 * (p - 1) / p * N * BETA + (p - 1) / p * N * GAMMA)
    assert co.reduce_scatter_time(N, ranks, c) == pytest.approx(
        (p - 1) * ALPHA + (p - 1) / p * N * BETA + (p - 1) / p * N * GAMMA)
    assert co.allgather_time(N, ranks, c) == pytest.approx((p - 1) * ALPHA + (p - 1) / p * N * BETA)
    assert co.alltoall_time(N, ranks, c) == pytest.approx((p - 1) * (ALPHA + N / p * BETA))


@pytest.mark.parametrize("p", [2, 3, 4, 7, 8])
def test_tree_forms(flat_cluster, p):
    c = flat_cluster(p)
    lg = math.ceil(math.log2(p))
    assert co.allreduce_time(N, range(p), c, "tree") == pytest.approx(
        2 * lg * (ALPHA + N * BETA) + lg * N * GAMMA)
    assert co.broadcast_time(N, range(p), c, "tree") == pytest.approx(lg * (ALPHA + N * BETA))


@pytest.mark.parametrize("p", [2, 4, 8])
def test_scatter_allgather_broadcast(flat_cluster, p):
    c = flat_cluster(p)
    lg = int(math.log2(p))
    assert co.broadcast_time(N, range(p), c, "scatter_allgather") == pytest.approx(
        (lg + p - 1) * ALPHA + 2 * (p - 1) / p * N * BETA)


def test_p2p(flat_cluster):
    c = flat_cluster(16)
    assert co.p2p_time(N, 0, 1, c) == pytest.approx(ALPHA + N * BETA)
    assert co.p2p_time(N, 0, 9, c) == pytest.approx(NET_ALPHA + N / NET_BW)
    assert co.p2p_time(N, 3, 3, c) == 0


def test_hierarchical_form(flat_cluster):
    nodes, local = 2, 4
    c = flat_cluster(nodes * local, gpus_per_node=local)
    m = N / local  # each local position allreduces 1/L of the buffer across nodes
    want = ((local - 1) * ALPHA + (local - 1) / local * N * (BETA + GAMMA)
            + 2 * (nodes - 1) * NET_ALPHA + 2 * (nodes - 1) / nodes * m / NET_BW + (nodes - 1) / nodes * m * GAMMA
            + (local - 1) * ALPHA + (local - 1) / local * N * BETA)
    assert co.allreduce_time(N, range(8), c, "hierarchical") == pytest.approx(want)


def test_auto_is_the_fastest(flat_cluster):
    c = flat_cluster(16, gpus_per_node=4)
    for n in (1e3, 1e5, 1e7, 1e9):
        each = [co.allreduce_time(n, range(16), c, a) for a in ("ring", "tree", "hierarchical")]
        assert co.allreduce_time(n, range(16), c) == pytest.approx(min(each))
    assert co.allreduce_algo(1e3, range(16), c) == "tree"  # latency-bound: log p steps win
    assert co.allreduce_algo(1e9, range(16), c) != "tree"


def test_concurrent_groups_share_a_nic(flat_cluster):
    # Four 2-rank groups across two nodes, one NIC per node: the NIC's bandwidth is split four ways.
    c = flat_cluster(8, gpus_per_node=4, nics=1)
    groups = [[0, 4], [1, 5], [2, 6], [3, 7]]
    alone = co.concurrent_allreduce_time(N, groups[:1], c, "ring")
    together = co.concurrent_allreduce_time(N, groups, c, "ring")
    band = N / NET_BW  # ring allreduce bandwidth term at p = 2: 2(p-1)/p n beta = n beta
    assert alone == pytest.approx(2 * NET_ALPHA + band + N / 2 * GAMMA)
    assert together == pytest.approx(2 * NET_ALPHA + 4 * band + N / 2 * GAMMA)
    # With a NIC per device the groups do not interfere.
    c4 = flat_cluster(8, gpus_per_node=4, nics=4)
    assert co.concurrent_allreduce_time(N, groups, c4, "ring") == pytest.approx(alone)


def test_bad_groups(flat_cluster):
    c = flat_cluster(4)
    with pytest.raises(ValueError):
        co.concurrent_allreduce_time(N, [[0, 1], [1, 2]], c)
    with pytest.raises(ValueError):
        co.allreduce_time(N, [0, 0, 1], c)
    assert co.allreduce_time(N, [2], c) == 0
    assert co.collective_time("allgather", N, [0, 1], c) == co.allgather_time(N, [0, 1], c)


def test_concurrent_dispatch(flat_cluster):
    c = flat_cluster(8)
    groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert co.concurrent_collective_time("allreduce", N, groups, c) == co.concurrent_allreduce_time(N, groups, c)
    assert co.concurrent_collective_time("alltoall", N, groups, c) == co.alltoall_time(N, groups[0], c)
    with pytest.raises(ValueError):
        co.concurrent_collective_time("gossip", N, groups, c)
