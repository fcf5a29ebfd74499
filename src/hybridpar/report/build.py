"""Build the report of a plan (and optionally a measured run) as one self-contained HTML page."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hybridpar.plans import Plan
from hybridpar.report import extras, figures
from hybridpar.report.layers import layer_rows, zoo_split_layers
from hybridpar.report.measured import Measured
from hybridpar.report.page import Section, nbytes, render, seconds


@dataclass(frozen=True)
class Report:
    html: str
    sections: tuple[str, ...]  # section ids, in page order
    notes: tuple[str, ...]  # what was left out and why


def _overview(plan: Plan) -> Section:
    s = Section("overview", "Plan")
    s.facts([("model", plan.model), ("input shape", "x".join(map(str, plan.input_shape or [])) or None),
             ("cluster", plan.cluster), ("world size", plan.world_size), ("global batch", plan.batch),
             ("data-parallel replicas (dp)", plan.dp), ("devices per replica (mp)", plan.mp),
             ("default layout", f"{plan.default_layout.to_strategy()} ({plan.default_layout.algorithm})"),
             ("strategy", plan.strategy)])
    for n in plan.notes:
        s.text(n)
    return s


def _layers(plan: Plan, notes: list[str]) -> Section:
    s = Section("layers", "Per-layer layout")
    model_layers, why = zoo_split_layers(plan.model)
    if why:
        s.note(why)
        notes.append(why)
    rows = layer_rows(plan, model_layers)
    if not rows:
        return s.text(f"Every layer uses the default layout {plan.default_layout.to_strategy()}.")
    keys = sorted({k for r in rows for k in r.predicted})
    s.text(f"{len(rows)} layers; highlighted rows differ from the plan's default layout.")
    s.table(["layer", "type", "algorithm", "sample", "channel", "filter", *keys],
            [[r.name, r.kind, r.layout.algorithm, r.layout.sample, r.layout.channel, r.layout.filter,
              *[r.predicted.get(k) for k in keys]] for r in rows],
            left=3, row_classes=["override" if r.overridden else "" for r in rows])
    return s


def _prediction(plan: Plan, notes: list[str]) -> Section:
    s = Section("predicted", "Predicted time and memory")
    p = plan.predicted
    if p is None:
        why = "the plan carries no prediction (made by hand or by --strategy without a cost model)"
        notes.append(why)
        return s.note(why)
    from hybridpar.cost.coverage import LABEL

    for n in plan.notes:  # figures resting on the roofline where a measurement was expected: said first
        if n.startswith(LABEL):
            s.note(n)
    s.facts([("step time", seconds(p.step_time_s)), ("compute", seconds(p.compute_s)),
             ("communication", seconds(p.comm_s)), ("exposed communication", seconds(p.exposed_comm_s)),
             ("idle", seconds(p.idle_s)),
             ("peak memory per device", nbytes(max(p.memory_bytes)) if p.memory_bytes else None)])
    s.image(figures.time_breakdown(p), "predicted step time breakdown")
    if p.memory_bytes:
        s.image(figures.memory_per_device(p.memory_bytes), "predicted memory per device")
    if p.comm_bytes:
        s.table(["collective", "bytes per step"], [[k, nbytes(v)] for k, v in sorted(p.comm_bytes.items())])
    png = figures.per_layer_times(p.per_layer) if p.per_layer else None
    if png:
        s.image(png, "predicted time per layer")
    return s


def _optional(section_id: str, title: str, make: Callable[[Plan], tuple[bytes | None, str | None]],
              plan: Plan, notes: list[str]) -> Section:
    s = Section(section_id, title)
    png, why = make(plan)
    if png:
        s.image(png, title)
    if why:
        s.note(why)
        notes.append(why)
    return s


def _measured(plan: Plan, meas: Measured) -> Section:
    s = Section("measured", "Predicted vs measured")
    pred = plan.predicted
    m_t, p_t = meas.step_time_s, pred.step_time_s if pred else None
    rows = [["step time", seconds(p_t) if p_t is not None else None,
             seconds(m_t) if m_t is not None else None,
             f"{(p_t - m_t) / m_t:+.1%}" if p_t is not None and m_t else None]]
    for k in sorted(set(meas.comm_bytes) | set(pred.comm_bytes if pred else {})):
        pb, mb = (pred.comm_bytes.get(k) if pred else None), meas.comm_bytes.get(k)
        rows.append([f"{k} bytes/step", nbytes(pb) if pb is not None else None,
                     nbytes(mb) if mb is not None else None,
                     f"{(pb - mb) / mb:+.1%}" if pb is not None and mb else None])
    s.facts([("run", meas.source), ("strategy", meas.strategy), ("world size", meas.world_size),
             ("steps", len(meas.losses) or len(meas.step_times_s)),
             ("samples/s", meas.samples_per_s)])
    if meas.world_size is not None and meas.world_size != plan.world_size:
        s.note(f"the run used {meas.world_size} ranks, the plan {plan.world_size}: not like for like")
    s.table(["figure", "predicted", "measured", "error"], rows)
    s.image(figures.predicted_vs_measured(pred, meas), "predicted vs measured")
    return s


def build_report(plan: Plan, measured: Measured | None = None, projection: dict | None = None,
                 on_section: Callable[[str], None] | None = None) -> Report:
    """The page for `plan` (with a measured run and a `hybridpar project --json` projection when given);
    `on_section(title)` is called as each part is made (for progress bars)."""
    notes: list[str] = []
    makers: list[tuple[str, Callable[[], Section]]] = [
        ("plan", lambda: _overview(plan)),
        ("layers", lambda: _layers(plan, notes)),
        ("prediction", lambda: _prediction(plan, notes)),
        ("projection", lambda: _optional("projection", "Scaling projection",
                                          lambda p: extras.projection_png(p, projection), plan, notes)),
        ("placement", lambda: _optional("placement", "Placement schedule (Gantt)", extras.gantt_png, plan, notes)),
    ]
    if measured is not None:
        makers.append(("measured", lambda: _measured(plan, measured)))
    sections = []
    for title, make in makers:
        if on_section:
            on_section(title)
        sections.append(make())
    page = render(f"hybridpar report: {plan.model} on {plan.world_size} ranks",
                  f"cluster {plan.cluster}, global batch {plan.batch}", sections)
    return Report(page, tuple(s.id for s in sections), tuple(notes))
