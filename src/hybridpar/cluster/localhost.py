"""The `localhost` cluster: this machine's cores as devices, one gloo rank per device.

All ranks sit on one node. Figures come from the calibration file when there is one (measured by
`hybridpar profile`), else from the conservative defaults in presets/localhost.yaml (labelled there as
approximations). With more ranks than cores the ranks time-share the cores: compute stretches by
ranks/cores (DeviceSpec.time_share), and the gloo alpha/beta are taken from the calibrated world
size nearest to the rank count, scaled by the ratio of the two oversubscription factors; so are the
per-kind collective times (allreduce, allgather, reduce-scatter, all-to-all per group size), which
the cost model takes over the link model wherever they cover a collective.
"""

from __future__ import annotations

import os

from hybridpar.cluster.calibration import Calibration, default_calibration_path, load_calibration
from hybridpar.cluster.model import Cluster, MeasuredCollective


def physical_cores() -> int:
    """Cores this process may run on (affinity mask), falling back to os.cpu_count()."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _physical_memory_bytes() -> float | None:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def oversubscription(ranks: int, cores: int) -> float:
    return max(1.0, ranks / cores)


def localhost_cluster(base: Cluster, ranks: int, calibration: str | os.PathLike | None) -> Cluster:
    """`base`: the preset built for `ranks` devices on one node (hybridpar.cluster.loader), given this
    machine's figures and the calibration's."""
    cores = physical_cores()
    cal = load_calibration(calibration)
    share = oversubscription(ranks, cores)
    # gloo's copies and sums run on the ranks' own cores when the ranks fill them: measured with the
    # weight-heavy CNN (2 ranks, 2 cores), DDP's step was its compute plus 2.7x its 38 MB allreduce,
    # nothing of it hidden behind backward (benchmarks/bench_weight_heavy.py, 2026-11-30)
    device = base.device.model_copy(update={"time_share": share, "comm_takes_compute": ranks >= cores})
    memory = _physical_memory_bytes()
    intra = base.intra
    sources = dict(base.sources)
    if memory is not None:
        device = device.model_copy(update={"memory_bytes": memory / ranks})
        sources["device.memory_bytes"] = "this machine's physical memory (os.sysconf) / ranks"
    notes = list(base.notes)
    if cal is not None:
        where = str(calibration or default_calibration_path())
        peaks = {"fp32": cal.peak_flops_fp32}
        if cal.peak_flops_bf16 is not None:
            peaks["bf16"] = cal.peak_flops_bf16
        device = device.model_copy(update={"name": cal.device_name, "peak_flops": peaks,
                                           "mem_bw_Bps": cal.mem_bw_Bps})
        for key in (*(f"device.peak_flops.{d}" for d in peaks), "device.mem_bw_Bps"):
            sources[key] = f"measured by `hybridpar profile` ({where})"
        skew = cal.skew(ranks)
        if skew != 1.0:  # a synchronous step moves at its slowest rank's pace (profile.rank_skew)
            device = device.model_copy(update={"time_share": share * skew})
            sources["device.time_share"] = (f"ranks/cores x {skew:.3g}, the slowest of {ranks} ranks in lockstep "
                                            f"against one process, measured by `hybridpar profile` ({where})")
        alpha, beta = _gloo_alpha_beta(cal, ranks, cores)
        if alpha is not None and beta is not None:
            intra = intra.model_copy(update={"link_latency_s": alpha, "link_bw_Bps": 1.0 / beta})
            for key in ("intra.link_latency_s", "intra.link_bw_Bps"):
                sources[key] = f"fitted to gloo allreduce runs by `hybridpar profile` ({where})"
            fit = cal.gloo_fit(ranks)
            if fit is not None and fit.beta_s_per_byte <= 0:  # _gloo_alpha_beta's bound, not the fit's slope
                sources["intra.link_bw_Bps"] = ("bounded by the largest gloo allreduce `hybridpar profile` timed "
                                                f"(its fit found no growth with size; {where})")
        measured = _measured_collectives(cal, ranks, cores)
        if measured:
            sources["measured_collectives"] = f"gloo collectives per kind timed by `hybridpar profile` ({where})"
        notes.append(f"calibrated from {where}")
        if cal.process_draw is not None:
            d = cal.process_draw
            notes.append(f"op records at a fresh process's speed: x{d.scale:.3g} (the reference iteration took "
                         f"{d.here_s * 1e3:.2f} ms in the profiling process, {d.fresh_s * 1e3:.2f} ms in fresh ones)")
    else:
        measured = ()
        notes.append("no calibration file: built-in approximate figures (run `hybridpar profile`)")
    return base.model_copy(update={"device": device, "intra": intra, "ranks_share_cores": True,
                                   "measured_collectives": measured,
                                   "cores": cores, "sources": sources, "notes": tuple(notes)})


def _measured_collectives(cal: Calibration, ranks: int, cores: int) -> tuple[MeasuredCollective, ...]:
    """Per kind and group size, the fits measured at the world size nearest to `ranks`, scaled like
    the link figures (_gloo_alpha_beta) when that world size is not `ranks`."""
    out = []
    for fit in cal.collective_fits(ranks):
        stretch = oversubscription(ranks, cal.cpu_count) / oversubscription(fit.world_size, cal.cpu_count)
        out.append(MeasuredCollective(kind=fit.kind, group_size=fit.group_size,
                                      intercept_s=fit.intercept_s * stretch,
                                      slope_s_per_byte=fit.slope_s_per_byte * stretch))
    return tuple(out)


def _gloo_alpha_beta(cal: Calibration, ranks: int, cores: int) -> tuple[float | None, float | None]:
    fit = cal.gloo_fit(ranks)
    if fit is None:
        return None, None
    beta = fit.beta_s_per_byte
    if beta <= 0 and fit.sizes_bytes and fit.times:
        # the fit found no growth with size (noise over a few sizes; the fit keeps its slope >= 0): the
        # largest measured allreduce's time, all of it put on the bytes, bounds the per-byte cost from
        # above. Before, such a file's alpha was dropped too and the preset's link figures used silently.
        n, t = max(zip(fit.sizes_bytes, (m.median_s for m in fit.times)))
        p = fit.world_size
        beta = t / n * p / (2 * (p - 1))
    if beta <= 0:
        return None, None
    # Calibration measured at its own cpu_count; scale by the change in oversubscription.
    stretch = oversubscription(ranks, cal.cpu_count) / oversubscription(fit.world_size, cal.cpu_count)
    return fit.alpha_s * stretch, beta * stretch
