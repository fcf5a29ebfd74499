"""Spatial splits: which input rows each rank needs for its output piece of a sliding-window op
(convolution, pooling), and which rows every other rank sends it (the halo exchange).

Pure Python, shared by the runtime (hybridpar.parallel.styles.spatial) and the cost model, so the bytes
the runtime sends are the bytes the planner prices. One spatial dimension at a time: a split over
height and width exchanges along height first, then along width on the height-extended pieces, which
carries the corners (the diagonal neighbour's rows reach a rank through its width neighbour).

Pieces are DTensor's (torch.chunk, hybridpar.layout.pieces): both the input and the output of a layer
are split that way, so a rank's output rows [o0, o1) need input rows
[o0*s - p, (o1-1)*s - p + d*(k-1) + 1), which may reach past the neighbours' pieces (pieces smaller
than the halo) and past the tensor's edges (the op's own padding, added locally).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from hybridpar.layout.pieces import piece_offsets, piece_sizes

SPATIAL_DIMS = ("depth", "height", "width")


@dataclass(frozen=True)
class Window:
    """A sliding window along one dimension of `size` elements (kernel, stride, padding, dilation)."""

    size: int
    kernel: int
    stride: int = 1
    padding: int = 0
    dilation: int = 1

    @property
    def out_size(self) -> int:
        return max(0, (self.size + 2 * self.padding - self.dilation * (self.kernel - 1) - 1) // self.stride + 1)

    def needed(self, out_start: int, out_stop: int) -> tuple[int, int]:
        """Input rows (unclipped: may start below 0 or end past `size`) that outputs [out_start,
        out_stop) read; (0, 0) when the output piece is empty."""
        if out_stop <= out_start:
            return (0, 0)
        return (out_start * self.stride - self.padding,
                (out_stop - 1) * self.stride - self.padding + self.dilation * (self.kernel - 1) + 1)


@dataclass(frozen=True)
class HaloPlan:
    """The exchange of one window over `parts` ranks: `window[r]` the input rows rank r's output piece
    needs (unclipped), `pad[r]` the (before, after) rows of padding it adds locally at the tensor's
    edges, `sends[q][r]` the global rows [start, stop) rank q sends rank r (q != r, empty when none)."""

    w: Window
    parts: int
    window: tuple[tuple[int, int], ...]
    pad: tuple[tuple[int, int], ...]
    sends: tuple[tuple[tuple[int, int], ...], ...]

    def in_piece(self, r: int) -> tuple[int, int]:
        off, size = piece_offsets(self.w.size, self.parts)[r], piece_sizes(self.w.size, self.parts)[r]
        return (off, off + size)

    def out_piece(self, r: int) -> tuple[int, int]:
        n = self.w.out_size
        off, size = piece_offsets(n, self.parts)[r], piece_sizes(n, self.parts)[r]
        return (off, off + size)

    def rows_sent(self, q: int) -> int:
        """Rows rank q sends in forward (and receives back, summed, in backward)."""
        return sum(b - a for r, (a, b) in enumerate(self.sends[q]) if r != q)

    def rows_received(self, r: int) -> int:
        return sum(self.sends[q][r][1] - self.sends[q][r][0] for q in range(self.parts) if q != r)


@lru_cache(maxsize=4096)  # the planner asks for every rank of every layout: O(parts^2) each, immutable
def halo_plan(w: Window, parts: int) -> HaloPlan:
    """Who sends what to whom for `w` split over `parts` ranks (input and output as torch.chunk cuts)."""
    in_off, in_size = piece_offsets(w.size, parts), piece_sizes(w.size, parts)
    out_off, out_size = piece_offsets(w.out_size, parts), piece_sizes(w.out_size, parts)
    windows, pads = [], []
    for r in range(parts):
        a, b = w.needed(out_off[r], out_off[r] + out_size[r])
        windows.append((a, b))
        pads.append((max(0, -a), max(0, b - w.size)) if b > a else (0, 0))
    sends = []
    for q in range(parts):
        qa, qb = in_off[q], in_off[q] + in_size[q]
        row = []
        for a, b in windows:
            lo, hi = max(a, qa, 0), min(b, qb, w.size)
            row.append((lo, hi) if hi > lo else (0, 0))
        sends.append(tuple(row))
    return HaloPlan(w, parts, tuple(windows), tuple(pads), tuple(sends))


def halo_elements(w: Window, parts: int, rank: int, cross_section: int) -> int:
    """Elements rank `rank` sends in one forward halo exchange along `w`'s dimension, `cross_section`
    elements per row (the product of the tensor's other local dimensions)."""
    if parts <= 1:
        return 0
    return halo_plan(w, parts).rows_sent(rank) * cross_section


def split_dims(degrees: dict[str, int], nd: int) -> list[tuple[int, int]]:
    """(tensor dim, ranks) of each spatially split dimension of an N C *spatial activation with `nd`
    spatial dims, in exchange order: a 1-D layer's width is dim 2; a 2-D layer's height dim 2, width
    dim 3; a 3-D layer's depth dim 2, height 3, width 4. `degrees`: the layout's depth/height/width.
    A degree on a dimension the layer does not have (depth=2 on a 2-D conv) is a ValueError."""
    names = SPATIAL_DIMS[3 - nd:] if 1 <= nd <= 3 else ()
    extra = [k for k in SPATIAL_DIMS if degrees.get(k, 1) > 1 and k not in names]
    if extra:
        raise ValueError(f"{', '.join(extra)} split on a {nd}-D layer (it has {', '.join(names) or 'no'} "
                         "spatial dimensions)")
    return [(2 + i, degrees.get(k, 1)) for i, k in enumerate(names) if degrees.get(k, 1) > 1]


def exchanges(sizes: tuple[int, ...], windows: dict[int, Window], degrees: dict[int, int], coords: dict[int, int],
              lead: int) -> list[tuple[int, int, int, int]]:
    """(tensor dim, ranks, elements sent forward, elements sent backward) of each halo exchange a rank
    makes, in order, for an input of spatial `sizes` (dims 2..) split `degrees[d]` ways along tensor dim
    d, this rank at piece `coords[d]`; `lead`: elements per spatial position (local samples x channels).
    A later exchange moves rows of the tensor the earlier ones extended (hybridpar.parallel.styles.spatial)."""
    order = sorted(degrees)
    plans = {d: halo_plan(windows[d], degrees[d]) for d in order}
    out = []
    for i, d in enumerate(order):
        cross = lead
        for e in range(2, 2 + len(sizes)):
            if e == d:
                continue
            if e in plans and order.index(e) < i:
                a, b = plans[e].window[coords[e]]
                cross *= b - a
            elif e in plans:
                lo, hi = plans[e].in_piece(coords[e])
                cross *= hi - lo
            else:
                cross *= sizes[e - 2]
        me = coords[d]
        out.append((d, degrees[d], plans[d].rows_sent(me) * cross, plans[d].rows_received(me) * cross))
    return out


def coords_of(degrees: dict[str, int], rank: int, order: tuple[str, ...]) -> dict[str, int]:
    """A rank's index along each named degree of a row-major mesh over `order` (outermost first)."""
    out: dict[str, int] = {}
    for name in reversed(order):
        n = degrees.get(name, 1)
        out[name] = rank % n
        rank //= n
    return out
