"""Rank functions of tests/parallel/test_mp_wavefront.py: recurrent models under
hybridpar.parallelize(model, mp=2, time_chunks=K) in the user's own loop (AdamW, a custom loss)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hybridpar
from hybridpar.plans import Plan

from . import wavefront_models as wm
from ._mp_own_loop_workers import fit

STEPS, BATCH = 3, 4

# name -> (factory, inputs(g) -> tuple, a placement crossing devices layer by layer)
MODELS = {
    "lm4": (wm.LSTMLM, lambda g: (wm.tokens(BATCH, g),), {"lstm[2]": 1, "lstm[3]": 1, "head": 1}),
    "gnmt": (wm.tiny_gnmt, lambda g: (wm.tokens(BATCH, g), wm.tokens(BATCH, g)),
             {"encoder.rnn_layers.2": 1, "encoder.rnn_layers.3": 1, "decoder.att_rnn": 1,
              "decoder.rnn_layers.1": 0, "decoder.rnn_layers.2": 1, "decoder.classifier": 1}),
}


def custom_loss(out, y):
    """Not a cross-entropy; every output takes part."""
    if isinstance(out, dict):
        logits = out["logits"]
        return F.multi_margin_loss(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) + out["hidden"].pow(2).mean()
    return F.nll_loss(F.log_softmax(out, -1).reshape(-1, out.shape[-1]), y.reshape(-1)) * 2


def batches(name: str):
    g = torch.Generator().manual_seed(11)
    return [(MODELS[name][1](g), wm.tokens(BATCH, g)) for _ in range(STEPS)]


def build(name: str):
    torch.manual_seed(5)
    return MODELS[name][0]().double()


def train(model, name: str) -> list[float]:
    return fit(model, batches(name), custom_loss)


def serial(name: str) -> tuple[dict, list[float]]:
    m = build(name)
    losses = train(m, name)
    return {k: v.detach().clone() for k, v in m.state_dict().items()}, losses


def _small_devices(n: int):
    """localhost with 100 KB per device: no device holds a test model whole."""
    from hybridpar.cluster import load_cluster

    cl = load_cluster("localhost", gpus=n)
    return cl.model_copy(update={"device": cl.device.model_copy(update={"memory_bytes": 100e3})})


def run_cases(cases) -> list[dict]:
    """Every rank: each (name, how, K) trained in the own loop. how: "plan" (a Plan with the test's
    placement) or "placer" (rank 0 places with time_chunks=K)."""
    out = []
    world = dist.get_world_size()
    for name, how, k in cases:
        model = build(name)
        if how == "plan":
            spec = Plan(model=name, world_size=world, batch=BATCH, dp=1, mp=world, placement=MODELS[name][2])
            model = hybridpar.parallelize(model, spec, time_chunks=k)
        else:  # on devices of 100 KB the placer must split (the LM needs 185 KB): its own placement, run
            model = hybridpar.parallelize(model, f"mp={world}", time_chunks=k, example_inputs=batches(name)[0][0],
                                          cluster=_small_devices(world))
        losses = train(model, name)
        state = hybridpar.full_state_dict(model)
        part = model.hybridpar.engine.partition
        chunk_moves = sum(1 for t in part.transfers if "_t" in t.node)
        out.append({"state": state, "losses": losses, "chunk_moves": chunk_moves,
                    "time_chunks": model.hybridpar.engine.time_chunks,
                    "placement": model.hybridpar.engine.placement})
    return out


def run_hybrid(names, k: int) -> list[dict]:
    """mp=2 x sample=2 (4 ranks): each model with the test's placement and K time chunks."""
    out = []
    for name in names:
        spec = Plan(model=name, world_size=4, batch=BATCH, dp=2, mp=2, placement=MODELS[name][2],
                    default_layout={"sample": 2})
        model = hybridpar.parallelize(build(name), spec, time_chunks=k)
        losses = train(model, name)
        part = model.hybridpar.engine.partition
        out.append({"state": hybridpar.full_state_dict(model), "losses": losses,
                    "time_chunks": model.hybridpar.engine.time_chunks,
                    "chunk_moves": sum(1 for t in part.transfers if "_t" in t.node)})
    return out
