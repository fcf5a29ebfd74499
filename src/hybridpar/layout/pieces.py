"""How a dimension of n elements is split over p ranks, and which pieces a rank of a P_C x P_F grid
holds. The convention is DTensor's (torch.chunk): pieces of ceil(n/p), the last ones smaller or
empty, so a rank's local piece is exactly its DTensor shard.

Pure Python: shared by the runtime and the analytic cost model (hybridpar.cost.layout_comm)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def piece_sizes(n: int, p: int) -> list[int]:
    """Sizes of the p pieces of n elements, as torch.chunk / DTensor's Shard cut them: ceil(n/p) each,
    the last ones smaller or empty (10 over 4 is 3, 3, 3, 1; 3 over 4 is 1, 1, 1, 0)."""
    full = -(-n // p) if p else 0
    return [max(0, min(full, n - k * full)) for k in range(p)]


def piece_offsets(n: int, p: int) -> list[int]:
    offs, acc = [], 0
    for s in piece_sizes(n, p):
        offs.append(acc)
        acc += s
    return offs


@dataclass(frozen=True)
class GridPos:
    """A rank's place in its sample group's P_C x P_F grid. Boundary tensors (layer inputs/outputs)
    are split into P = P_C*P_F channel pieces; rank g = i*P_F + j holds piece g.

    Stationary-w keeps that layout on both sides: the input channels of the weight block are the
    contiguous pieces of row i (i*P_F .. i*P_F+P_F-1, gathered in the filter group), and its filters
    are the strided pieces j, P_F+j, ... (so the reduce-scatter in the channel group hands rank (i,j)
    output piece i*P_F+j = g)."""

    channel: int  # P_C
    filter: int  # P_F
    g: int  # position 0..P_C*P_F-1

    @property
    def size(self) -> int:
        return self.channel * self.filter

    @property
    def i(self) -> int:
        return self.g // self.filter

    @property
    def j(self) -> int:
        return self.g % self.filter

    def in_piece_ids(self) -> list[int]:
        """Boundary pieces forming this rank's weight columns (in gather order of the filter group)."""
        return [self.i * self.filter + jj for jj in range(self.filter)]

    def out_piece_ids(self) -> list[int]:
        """Boundary pieces forming this rank's weight rows (in scatter order of the channel group)."""
        return [ii * self.filter + self.j for ii in range(self.channel)]


def ranges(sizes: Sequence[int], ids: Iterable[int]) -> list[tuple[int, int]]:
    """(offset, size) ranges of the pieces `ids` of a dimension split into `sizes`."""
    offs = [sum(sizes[:k]) for k in range(len(sizes))]
    return [(offs[k], sizes[k]) for k in ids]


@dataclass(frozen=True)
class Split:
    """How a global [N, C, ...] activation lies over the world: samples in `sample` blocks (one per
    sample group), channels in `g_size` pieces inside a group; rank r = s*g_size + g."""

    sample: int
    g_size: int

    def box(self, rank: int, n: int, c: int) -> tuple[int, int, int, int]:
        """(sample start, sample end, channel start, channel end) rank holds of an [n, c, ...] tensor."""
        s, g = divmod(rank, self.g_size)
        per = n // self.sample
        off, size = piece_offsets(c, self.g_size)[g], piece_sizes(c, self.g_size)[g]
        return s * per, (s + 1) * per, off, off + size


def overlap(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> tuple[int, int, int, int] | None:
    n0, n1, c0, c1 = max(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), min(a[3], b[3])
    return (n0, n1, c0, c1) if n0 < n1 and c0 < c1 else None


def moved_elements(n: int, c: int, inner: int, src: Split, dst: Split, rank: int, world: int) -> int:
    """Elements `rank` sends to other ranks when redistributing an [n, c, inner...] tensor from src to
    dst: exactly what it holds and another rank needs (nothing is sent twice, nothing kept is sent)."""
    mine = src.box(rank, n, c)
    total = 0
    for q in range(world):
        if q != rank and (o := overlap(mine, dst.box(q, n, c))):
            total += (o[1] - o[0]) * (o[3] - o[2]) * inner
    return total


def held(c_sizes: list[int], G: int, g: int) -> list[tuple[int, int]]:
    """Channel concatenation of inputs with c_sizes channels, each split into G pieces: the global
    channel ranges [start, end) of the concatenation that rank g holds, per input."""
    out, base = [], 0
    for c in c_sizes:
        off, n = piece_offsets(c, G)[g], piece_sizes(c, G)[g]
        out.append((base + off, base + off + n))
        base += c
    return out


def needed(c_sizes: list[int], G: int, g: int) -> tuple[int, int]:
    total = sum(c_sizes)
    off = piece_offsets(total, G)[g]
    return off, off + piece_sizes(total, G)[g]


def inter(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def moved_channels(c_sizes: list[int], G: int, g: int) -> int:
    """Channels rank g sends to other ranks of its sample group for one concatenation."""
    mine = held(c_sizes, G, g)
    return sum(i[1] - i[0] for q in range(G) if q != g for r in mine if (i := inter(r, needed(c_sizes, G, q))))


def received_channels(c_sizes: list[int], G: int, g: int) -> int:
    """Channels of rank g's concatenation piece held by other ranks (what it sends in backward)."""
    want = needed(c_sizes, G, g)
    return sum(i[1] - i[0] for r in range(G) if r != g for h in held(c_sizes, G, r) if (i := inter(h, want)))
