"""From the placer's result to the placement an MP plan runs on a module: module names, plus the
functional nodes (a branch concat, a residual add) by their fx node name."""

from __future__ import annotations

from torch import nn


def placement_from_outcome(outcome, module: nn.Module, example_inputs: tuple | None = None) -> dict[str, int]:
    """The placer's plan names modules only; functional nodes are added by their node name in the graph
    the MP runtime runs (torch.fx's, else torch.export's at `example_inputs`: hybridpar.graph.runnable)
    from the placed graph's members, so that they run where the placer scheduled them rather than next
    to their first input."""
    from hybridpar.graph.runnable import runnable_graph

    placement = dict(outcome.plan.placement or {})
    fx_nodes = {n.name for n in runnable_graph(module, example_inputs).graph.nodes}
    for node, dev in zip(outcome.graph.nodes, outcome.result.assignment):
        for member in node.attr("members") or (node.name,):
            if member in fx_nodes:
                placement.setdefault(member, int(dev))
    return placement


def predicted_p2p_bytes(outcome) -> int:
    """Bytes the placer's cost model moves between devices per step for its assignment: each task's
    output once to every other device consuming it, and its gradient back. The runtime's measured
    send bytes (summed over the ranks of a replica) equal this for the same placement."""
    prob, assign = outcome.problem, outcome.result.assignment
    total = 0
    for i, task in enumerate(prob.tasks):
        consumers = {assign[j] for j in prob.succs[i]} - {assign[i]}
        total += task.out_bytes * len(consumers)
    return 2 * total
