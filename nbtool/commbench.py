"""``%commbench`` results (kernel side, pure Python; plots are drawn by nbtool.widgets): sizes, table, fit.

Per op each rank makes ``repeat`` passes over the sizes, timing one batch
of ``iters`` calls per size and pass (nbtool.rank.commbench). Each
repetition's time is nccl-tests': the mean time per call of the slowest rank;
the reported time is the median over repetitions (``rep_min_s`` /
``rep_max_s``: their spread), and the fit uses these medians. min / median /
max across ranks (of each rank's median) are kept too. algbw = S / t and busbw = algbw x the op's
bus factor (nbtool.collectives, which also defines S per op). ``wrong`` counts
result elements that differ from the expected values on any rank.

The alpha-beta (latency-bandwidth) model is t(S) = alpha + f(op, n) * S / B,
with B a bus bandwidth; it is fitted by least squares on relative error
(each point weighted by 1 / t^2) so small and large messages count alike.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field

from .collectives import bandwidths, bus_factor

BENCH_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}
_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": 2**30, "gb": 2**30, "gib": 2**30}


def parse_size(text: str) -> int:
    """'4B', '64K', '1MB', '256MiB' -> bytes (binary units, as nccl-tests' -b/-e)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"size {text!r} is not a number with an optional unit (B, KB, MB, GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def size_sweep(spec: str, factor: float) -> list[int]:
    """'4B:256MB' with factor 2 -> [4, 8, ..., 256 MiB] (a single size is allowed)."""
    lo_text, _, hi_text = spec.partition(":")
    lo = parse_size(lo_text)
    hi = parse_size(hi_text) if hi_text else lo
    if lo <= 0:
        raise ValueError(f"--sizes {spec!r}: the smallest size must be > 0")
    if lo > hi:
        raise ValueError(f"--sizes {spec!r}: min {lo} B > max {hi} B")
    if factor <= 1 and lo != hi:
        raise ValueError(f"--factor {factor:g} must be > 1 to sweep from {lo} B to {hi} B")
    sizes, s = [], float(lo)
    while s <= hi * (1 + 1e-9):
        sizes.append(int(round(s)))
        s *= factor if factor > 1 else 2
    return sorted(set(sizes))


def link_groups(nodes: list[int]) -> dict[str, tuple[int, ...]]:
    """The ranks that measure each link apart, from each rank's node: intra-host is the first node
    holding two or more ranks (their traffic never leaves it); inter-host is the first rank of every
    node (one per host, so every byte crosses the network). A link that does not exist is absent."""
    by: dict = {}
    for rank, node in enumerate(nodes):
        by.setdefault(node, []).append(rank)
    if len(by) < 2:
        return {}
    hosts = [r for _, r in sorted(by.items())]
    intra = next((r for r in hosts if len(r) >= 2), None)
    return {**({"intra-host": tuple(intra)} if intra else {}), "inter-host": tuple(r[0] for r in hosts)}


def element_count(op: str, size_bytes: int, n: int, elem: int) -> int:
    """Elements for S ~ size_bytes: at least one per rank, and divisible by n where the op splits."""
    count = max(1, size_bytes // elem)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        count = max(n, count // n * n)
    return count


@dataclass
class Fit:
    alpha_s: float  # latency
    bus_bandwidth: float  # B in bytes/s
    r2: float  # on relative residuals: 1 - sum(r^2) / sum((t/mean - 1)^2) of the weighted problem
    max_rel_err: float
    points: int


def fit_alpha_beta(op: str, n: int, sizes: list[int], seconds: list[float]) -> Fit:
    """Fit t = alpha + f(op, n) * S / B by weighted least squares (weights 1/t^2)."""
    f = bus_factor(op, n)
    xs = [f * s for s in sizes]
    # minimise sum(((alpha + beta x) - t)^2 / t^2): linear least squares on rows (1/t, x/t) -> 1
    a11 = sum(1 / t**2 for t in seconds)
    a12 = sum(x / t**2 for x, t in zip(xs, seconds))
    a22 = sum(x * x / t**2 for x, t in zip(xs, seconds))
    b1 = sum(1 / t for t in seconds)
    b2 = sum(x / t for x, t in zip(xs, seconds))
    det = a11 * a22 - a12 * a12
    if len(sizes) < 2 or det == 0:
        raise ValueError("an alpha-beta fit needs at least two different sizes")
    alpha = (b1 * a22 - b2 * a12) / det
    beta = (a11 * b2 - a12 * b1) / det
    rel = [(alpha + beta * x - t) / t for x, t in zip(xs, seconds)]
    ss_res = sum(r * r for r in rel)
    mean_t = sum(seconds) / len(seconds)
    ss_tot = sum((t / mean_t - 1) ** 2 for t in seconds) or 1e-30
    return Fit(alpha, 1 / beta if beta > 0 else math.inf, 1 - ss_res / ss_tot, max(abs(r) for r in rel), len(sizes))


@dataclass
class CommbenchResult:
    backend: str
    ranks: list
    dtype: str
    iters: int
    warmup: int
    inplace: bool
    label: str = ""
    repeat: int = 1
    min_batch_s: float = 0.0  # sizes whose ``iters`` calls took less got more (each row's "iters")
    link: str = ""  # "intra-host" or "inter-host" when the ranks were chosen to measure one link (link_groups)
    rows: list = field(default_factory=list)  # one dict per (op, size)
    fits: dict = field(default_factory=dict)  # op -> Fit

    @classmethod
    def from_rank_rows(cls, per_rank: list[list[dict]], **meta) -> "CommbenchResult":
        res = cls(**meta)
        n = len(res.ranks)
        by_key: dict = {}
        for rows in per_rank:
            for r in rows:
                by_key.setdefault((r["op"], r["count"]), []).append(r)
        for (op, count), rs in sorted(by_key.items(), key=lambda kv: (BENCH_OPS.index(kv[0][0]), kv[0][1])):
            times = sorted(r["seconds"] for r in rs)  # each rank's median
            # per repetition the slowest rank, as nccl-tests reports; then the median over repetitions
            reps = sorted(max(vals) for vals in zip(*(r["samples"] for r in rs)))
            t = reps[len(reps) // 2]
            alg, bus = bandwidths(op, rs[0]["size_bytes"], n, t)
            res.rows.append({"op": op, "size_bytes": rs[0]["size_bytes"], "count": count, "dtype": res.dtype,
                             "seconds": t, "rep_min_s": reps[0], "rep_max_s": reps[-1],
                             "min_s": times[0], "median_s": times[len(times) // 2], "max_s": times[-1],
                             "algbw": alg, "busbw": bus, "iters": rs[0].get("iters", res.iters),
                             "wrong": sum(r["wrong"] for r in rs),
                             "clock": rs[0]["clock"]})
        for op in {r["op"] for r in res.rows}:
            pts = [r for r in res.rows if r["op"] == op]
            if len({r["size_bytes"] for r in pts}) >= 2:
                res.fits[op] = fit_alpha_beta(op, n, [r["size_bytes"] for r in pts], [r["seconds"] for r in pts])
        return res

    @property
    def wrong(self) -> int:
        return sum(r["wrong"] for r in self.rows)

    @property
    def parts(self) -> list:
        """The sweeps this result holds: itself (CommbenchLinks holds several)."""
        return [self]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["fits"] = {op: asdict(f) for op, f in self.fits.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CommbenchResult":
        d = dict(d)
        fits = {op: Fit(**f) for op, f in d.pop("fits", {}).items()}
        return cls(**d, fits=fits)

    def export(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "CommbenchResult":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def text(self, deterministic: bool = False) -> str:
        """nccl-tests-style columns; ``deterministic`` keeps only size, count, type, factor and #wrong."""
        n = len(self.ranks)
        head = f"{'op':>14} {'size(B)':>11} {'count':>10} {'type':>8} {'busfactor':>9}"
        if not deterministic:
            head += (f" {'time(us)':>10} {'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'min/max(us) over repeats':>25}"
                     f" {'min/med/max(us) across ranks':>30}")
        calls = not deterministic and self.min_batch_s > 0  # calls per batch differ by size
        if calls:
            head += f" {'iters':>8}"
        head += f" {'#wrong':>6}"
        link = f" ({self.link} link)" if self.link else ""
        floor = f"batches >= {self.min_batch_s * 1e3:g} ms" + (": the iters column" if calls else "")
        iters = f">= {self.iters} iters ({floor})" if self.min_batch_s > 0 else f"{self.iters} iters"
        lines = [f"# {self.label or 'commbench'}{link}: {self.backend}, ranks {self.ranks}, {self.dtype}, "
                 f"{self.repeat} passes x {iters} after {self.warmup} warm-up (time: median of the passes), "
                 f"{'in-place' if self.inplace else 'out-of-place'}",
                 head]
        for r in self.rows:
            line = (f"{r['op']:>14} {r['size_bytes']:>11} {r['count']:>10} {r['dtype']:>8} "
                    f"{bus_factor(r['op'], n):>9.3f}")
            if not deterministic:
                mmm = f"{r['min_s'] * 1e6:.1f}/{r['median_s'] * 1e6:.1f}/{r['max_s'] * 1e6:.1f}"
                spread = f"{r.get('rep_min_s', r['seconds']) * 1e6:.1f}/{r.get('rep_max_s', r['seconds']) * 1e6:.1f}"
                line += (f" {r['seconds'] * 1e6:>10.1f} {r['algbw'] / 1e9:>11.3f} {r['busbw'] / 1e9:>11.3f} "
                         f"{spread:>25} {mmm:>30}")
            if calls:
                line += f" {r.get('iters', self.iters):>8}"
            lines.append(line + f" {r['wrong']:>6}")
        if not deterministic:
            for op, fit in sorted(self.fits.items()):
                lines.append(f"# fit {op}: t = {fit.alpha_s * 1e6:.1f} us + S x {bus_factor(op, n):.3f} / "
                             f"{fit.bus_bandwidth / 1e9:.3f} GB/s  (R2 {fit.r2:.3f}, max rel. error "
                             f"{fit.max_rel_err:.0%}, {fit.points} sizes)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()

    def figure(self, *others: "CommbenchResult"):
        """Latency (log-log) and busbw vs size; pass other results to overlay them (drawn by nbtool.widgets)."""
        from .widgets.commbench_view import result_figure

        return result_figure(self, *others)

    def _repr_html_(self) -> str:
        # one unwrapped line per row: JupyterLab wraps long text/plain lines
        import html

        return f"<pre style='white-space:pre; overflow-x:auto'>{html.escape(self.text())}</pre>"


@dataclass
class CommbenchLinks:
    """A sweep on a cluster of several hosts: all ranks, then each link apart (intra-host and
    inter-host, ``link_groups``). ``.fits`` are the whole world's; ``part(link)`` one link's result."""

    results: list  # CommbenchResult: the world first, then one per link measured

    @property
    def parts(self) -> list:
        return self.results

    def part(self, link: str):
        return next((r for r in self.results if r.link == link), None)

    @property
    def fits(self) -> dict:
        return self.results[0].fits

    @property
    def wrong(self) -> int:
        return sum(r.wrong for r in self.results)

    def text(self, deterministic: bool = False) -> str:
        return "\n\n".join(r.text(deterministic) for r in self.results)

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        return "".join(r._repr_html_() for r in self.results)

    def figure(self, *others):
        """Every part overlaid (and other results after them)."""
        return self.results[0].figure(*self.results[1:], *others)

    def export(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"links": [r.to_dict() for r in self.results]}, f, indent=1)

    @classmethod
    def load(cls, path: str) -> "CommbenchLinks":
        with open(path) as f:
            return cls([CommbenchResult.from_dict(d) for d in json.load(f)["links"]])
