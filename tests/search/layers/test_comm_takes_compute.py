"""Where gloo's exchanges run on the cores that compute (localhost, ranks filling every core), gradient
buckets launched during backward hide nothing: the planner prices the step as compute plus every
exchange. On a GPU preset they overlap backward."""

import torch
from torch import nn

from hybridpar.cluster import load_cluster
from hybridpar.cluster.localhost import physical_cores
from hybridpar.search.layers.planner import plan_model


def _wide():
    # 3 x 4 MiB of weights: several gradient buckets, launched while backward still runs
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def test_localhost_ranks_filling_the_cores_hide_no_exchange():
    cores = physical_cores()
    assert load_cluster("localhost", gpus=cores).device.comm_takes_compute
    assert not load_cluster("dgx1-v100", gpus=8).device.comm_takes_compute
    model = (_wide(), torch.randn(8, 1024))
    local = plan_model(model, "localhost", gpus=cores, batch=8, strategy=f"sample={cores}").prediction
    assert local.comm_s > 0 and abs(local.exposed_comm_s - local.comm_s) <= 1e-9 * local.comm_s
    assert abs(local.step_time_s - (local.compute_s + local.comm_s)) <= 1e-9 * local.step_time_s
    gpu = plan_model(model, "dgx1-v100", gpus=8, batch=64, strategy="sample=8").prediction
    assert gpu.exposed_comm_s < gpu.comm_s  # buckets overlap backward on GPUs
