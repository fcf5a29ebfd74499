"""The real DGX-1 hybrid cube-mesh: rings ride NVLink, pairs without a link take the host path."""

import pytest

from hybridpar.cluster import load_cluster
from hybridpar.cost import collectives as co

N = 64e6


@pytest.fixture(scope="module")
def dgx1():
    return load_cluster("dgx1-v100", gpus=16)


def test_pair_without_link_slower_than_one_slower_than_two(dgx1):
    none, one, two = ([0, 5], [0, 1], [0, 3])
    assert (dgx1.nvlinks(*none), dgx1.nvlinks(*one), dgx1.nvlinks(*two)) == (0, 1, 2)
    for f in (lambda g: co.allreduce_time(N, g, dgx1), lambda g: co.p2p_time(N, *g, dgx1)):
        assert f(none) > f(one) > f(two)
    # Bandwidth-bound: two links take about half the transfer time of one (the reduction is the same).
    reduce_s = N / 2 * dgx1.gamma_s_per_byte
    assert co.allreduce_time(N, two, dgx1) - reduce_s == pytest.approx(
        (co.allreduce_time(N, one, dgx1) - reduce_s) / 2, rel=0.01)


def test_eight_gpu_ring_follows_the_double_links(dgx1):
    order = co.ring_order(range(8), dgx1)
    hops = [dgx1.nvlinks(order[i], order[(i + 1) % 8]) for i in range(8)]
    assert hops == [2] * 8  # the Hamiltonian cycle over the eight double-NVLink pairs
    # A second ring over the eight single links runs beside it with 1/3 of the data, so all six
    # NVLinks of every GPU carry traffic, and each ring runs in both directions.
    cycles = co._cycle_set(tuple(range(8)), dgx1)
    assert [share for _, share in cycles] == pytest.approx([2 / 3, 1 / 3])
    second = cycles[1][0]
    assert [dgx1.nvlinks(second[i], second[(i + 1) % 8]) for i in range(8)] == [1] * 8
    links = 3 * dgx1.intra.link_bw_Bps  # per direction, per GPU
    want = (dgx1.collective_base_latency_s + 14 * dgx1.intra.link_latency_s + 2 * 7 / 8 * N / (2 * links)
            + 7 / 8 * N * dgx1.gamma_s_per_byte)
    assert co.allreduce_time(N, range(8), dgx1, "ring") == pytest.approx(want)


def test_hierarchical_uses_nvlink_inside_nodes(dgx1):
    flat = load_cluster("dgx-a100", gpus=16)  # same shape, switch inside the node
    t_h = co.allreduce_time(N, range(16), dgx1, "hierarchical")
    assert t_h < co.allreduce_time(N, range(16), dgx1, "ring")
    # A 4-GPU group inside one node: {0,1,2,3} has NVLink on every pair; in {0,1,6,7} neither 0 nor 1
    # has a link to 6 or 7, so every ring crosses the host path twice.
    assert co.allreduce_time(N, [0, 1, 2, 3], dgx1) < co.allreduce_time(N, [0, 1, 6, 7], dgx1) / 2
    assert flat.num_devices == 16


def test_segmented_allreduce_contention_on_the_host_path(dgx1):
    # 0-5 and 1-4 have no NVLink: both cross the same socket link and share it.
    alone = co.concurrent_allreduce_time(N, [[0, 5]], dgx1, "ring")
    shared = co.concurrent_allreduce_time(N, [[0, 5], [1, 4]], dgx1, "ring")
    assert shared > 1.8 * alone
    # Pairs on their own NVLinks do not interfere.
    nv = [[0, 3], [1, 2], [4, 7], [5, 6]]
    assert co.concurrent_allreduce_time(N, nv, dgx1) == pytest.approx(co.allreduce_time(N, nv[0], dgx1))


def test_large_cluster_is_fast_enough_to_plan(dgx1):
    big = load_cluster("dgx1-v100", gpus=1024)
    t = co.allreduce_time(N, range(1024), big)
    assert co.allreduce_time(N, range(8), dgx1) < t < co.allreduce_time(N, range(1024), big, "ring")


def test_hierarchical_intra_phase_sees_the_pair_links(dgx1):
    # Two GPUs per node on two nodes: the intra-node phases ride the pair's links.
    no_link = co.allreduce_time(N, [0, 5, 8, 13], dgx1, "hierarchical")
    one_link = co.allreduce_time(N, [0, 1, 8, 9], dgx1, "hierarchical")
    two_links = co.allreduce_time(N, [0, 3, 8, 11], dgx1, "hierarchical")
    assert no_link > one_link > two_links
