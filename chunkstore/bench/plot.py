"""Pictures of a bench's rows (its ``--json`` lines): ``bench quality`` as accuracy against
document length per method (its 95% interval as error bars), ``bench workload`` as requests/s
against vLLM's prefix caching per pool share, beside the hit-rate curve of its replay.
``chunkstore bench quality|workload --plot FILE.png`` draws the run's; ``chunkstore plot
ROWS.jsonl FILE.png`` draws saved lines. Needs matplotlib (the ``plot`` extra)."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

DPI = 110


class RowError(ValueError):
    """Row ``index`` (0-based) lacks a field the picture needs, or holds one of another type."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"row {index + 1}: {reason}")
        self.index = index
        self.reason = reason


# The fields each row is drawn from, and their kinds; a row of workload by its "way".
_QUALITY = {"method": "text", "doc_tokens": "number", "accuracy": "number", "cases": "number"}
_QUALITY |= {"ci95": "interval"}
_TTFT = {"ttft_p50_s": "number", "ttft_p99_s": "number"}
_WORKLOAD = {
    "apc": _TTFT,
    "replay": {"policy": "text", "pool_share": "number", "store_hit_rate": "number"},
    "replay-disk": {},
}
_WAY = {"pool_share": "number", "throughput_vs_apc": "number"} | _TTFT


def plot(rows: Iterable[dict[str, Any]], path: str | Path) -> Path:
    """Draw ``rows`` (of one bench) to ``path`` (PNG); ValueError for rows it cannot draw
    (``RowError`` naming the row and the field for one of them)."""
    rows = list(rows)
    if not rows:
        raise ValueError("no rows: a bench's --json output has one JSON object a line")
    for n, row in enumerate(rows):
        _check(n, row, {"bench": "text"})
    benches = {row["bench"] for row in rows}
    if benches == {"quality"}:
        for n, row in enumerate(rows):
            _check(n, row, _QUALITY)
        figure = _quality(rows)
    elif benches == {"workload"}:
        for n, row in enumerate(rows):
            _check(n, row, {"way": "text"})
            _check(n, row, _WORKLOAD.get(row["way"], _WAY))
        figure = _workload(rows)
    else:
        raise ValueError(f"rows of {sorted(benches)}: plots draw quality or workload")
    out = Path(path)
    figure.savefig(out, dpi=DPI, bbox_inches="tight")
    return out


def _check(index: int, row: dict[str, Any], fields: dict[str, str]) -> None:
    for field, kind in fields.items():
        if field not in row:
            raise RowError(index, f"no {field!r} ({kind})")
        value = row[field]
        if kind == "text":
            fits = isinstance(value, str)
        elif kind == "number":
            fits = _number(value)
        else:  # interval: [low, high]
            fits = isinstance(value, list) and len(value) == 2 and all(map(_number, value))
        if not fits:
            shown = json.dumps(value)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            raise RowError(index, f"{field!r} is {shown}, not {_KINDS[kind]}")


_KINDS = {"text": "a string", "number": "a number", "interval": "[low, high] (two numbers)"}


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def numbered_rows(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """A bench's ``--json`` output: one JSON object a line (other lines skipped), each with
    its line number (from 1)."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.startswith("{"):
            try:
                rows.append((number, json.loads(line)))
            except ValueError as err:
                raise ValueError(f"line {number} is not JSON: {err}") from None
    return rows


def pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plots need matplotlib: pip install 'chunkstore[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _quality(rows: list[dict[str, Any]]) -> Any:
    """Accuracy per method against document length (one panel per split)."""
    plt = pyplot()
    splits = sorted({str(row.get("split", "")) for row in rows})
    figure, axes = plt.subplots(1, len(splits), figsize=(6.4 * len(splits), 4.2), squeeze=False)
    for ax, split in zip(axes[0], splits, strict=True):
        by_method: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for row in rows:
            if str(row.get("split", "")) == split:
                by_method[row["method"]].append(row)
        lengths = sorted({row["doc_tokens"] for rows_ in by_method.values() for row in rows_})
        if len(lengths) == 1:  # one length: a bar a method
            mine = [rows_[0] for rows_ in by_method.values()]
            low = [r["accuracy"] - r["ci95"][0] for r in mine]
            high = [r["ci95"][1] - r["accuracy"] for r in mine]
            ax.bar(list(by_method), [r["accuracy"] for r in mine], yerr=[low, high], capsize=4)
            ax.tick_params(axis="x", labelrotation=20, labelsize=8)
        for n, (method, mine) in enumerate(by_method.items() if len(lengths) > 1 else ()):
            mine.sort(key=lambda r: r["doc_tokens"])
            # Side by side at each length: the methods' intervals overlap otherwise.
            shift = (n - (len(by_method) - 1) / 2) * (_spacing(lengths) * 0.04)
            x = [r["doc_tokens"] + shift for r in mine]
            y = [r["accuracy"] for r in mine]
            low = [r["accuracy"] - r["ci95"][0] for r in mine]
            high = [r["ci95"][1] - r["accuracy"] for r in mine]
            ax.errorbar(x, y, yerr=[low, high], marker="o", capsize=3, label=method)
        cases = {row["cases"] for rows_ in by_method.values() for row in rows_}
        ax.set_title(f"{split or 'cases'}: {'/'.join(map(str, sorted(cases)))} cases a length")
        ax.set_xlabel(
            "document length (tokens)"
            if len(lengths) > 1
            else f"documents of ~{lengths[0]:.0f} tokens"
        )
        ax.set_ylabel("answers correct")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        if len(lengths) > 1:
            ax.legend(fontsize=8)
    model = rows[0].get("model") or ""
    figure.suptitle(f"bench quality {model}".strip())
    return figure


def _spacing(lengths: list[float]) -> float:
    return (max(lengths) - min(lengths)) if len(lengths) > 1 else 100.0


def _workload(rows: list[dict[str, Any]]) -> Any:
    """Requests/s against APC's per pool share, each way; TTFT p50 and p99 of every way and
    APC's; the replay's store hit rate per pool share, each policy (where the run replayed)."""
    plt = pyplot()
    apc = [r for r in rows if r["way"] == "apc"]
    ways = [r for r in rows if r["way"] not in ("apc", "replay", "replay-disk")]
    curve = [r for r in rows if r["way"] == "replay"]
    panels = 1 + bool(ways) + bool(curve)
    figure, axes = plt.subplots(1, panels, figsize=(6.4 * panels, 4.2), squeeze=False)
    left = list(axes[0])
    if ways:
        _throughput(left.pop(0), ways)
    _ttfts(left.pop(0), apc + ways)
    if curve:
        _hit_curve(left.pop(0), curve)
    first = rows[0]
    figure.suptitle(f"bench workload {first.get('model', '')}, {first.get('requests')} requests")
    return figure


def _throughput(ax: Any, ways: list[dict[str, Any]]) -> None:
    by_way: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in ways:
        by_way[row["way"].replace(f"@{row['pool_share']:g}", "")].append(row)
    shares = {row["pool_share"] for row in ways}
    for n, (family, mine) in enumerate(by_way.items()):
        mine.sort(key=lambda r: r["pool_share"])
        ratios = [r["throughput_vs_apc"] for r in mine]
        if len(shares) > 1:
            ax.plot([r["pool_share"] for r in mine], ratios, marker="o", label=family)
        else:  # one share: a bar a way
            ax.bar([n], ratios, label=family)
            ax.set_xticks([])
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="vLLM prefix caching")
    only = f" (pool: {min(shares):g} of the working set)" if len(shares) == 1 else ""
    ax.set_xlabel("pool, share of the working set" if len(shares) > 1 else f"ways{only}")
    ax.set_ylabel("requests/s vs vLLM's prefix caching")
    ax.set_title("throughput")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _ttfts(ax: Any, ways: list[dict[str, Any]]) -> None:
    names = [row["way"] for row in ways]
    at = list(range(len(ways)))
    ax.bar([x - 0.2 for x in at], [r["ttft_p50_s"] for r in ways], width=0.4, label="p50")
    ax.bar([x + 0.2 for x in at], [r["ttft_p99_s"] for r in ways], width=0.4, label="p99")
    ax.set_xticks(at, names, rotation=20, fontsize=8)
    ax.set_ylabel("time to first token (s)")
    ax.set_title("TTFT")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)


def _hit_curve(ax: Any, curve: list[dict[str, Any]]) -> None:
    by_policy: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in curve:
        by_policy[row["policy"]].append(row)
    for policy, mine in by_policy.items():
        mine.sort(key=lambda r: r["pool_share"])
        shares = [r["pool_share"] for r in mine]
        ax.plot(shares, [r["store_hit_rate"] for r in mine], marker="o", label=policy)
    ax.set_xlabel("pool, share of the working set")
    ax.set_ylabel("store hit rate (replayed)")
    ax.set_ylim(0, 1.05)
    ax.set_title("hit-rate curve")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
