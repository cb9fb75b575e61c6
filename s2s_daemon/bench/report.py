"""Benchmark results: per-configuration summaries, ratios, the terminal table, JSON and PNG."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from s2s_daemon.bench.performance_page import markdown_table
from s2s_daemon.bench.texts import BenchText
from s2s_daemon.errors import UnavailableError

SCHEMA = "s2s-daemon.bench/1"
"""Version tag of the JSON document; bumped when a field changes meaning."""


@dataclass(frozen=True, slots=True)
class ConfigSpec:
    """One configuration to measure, parsed from ``--engine NAME[:key=value,...]``."""

    label: str
    """What the table shows: the ``--engine`` argument as written."""
    engine: str
    """Registry name (``torch``, ``mlx``...) or ``qwen-tts`` for the official package."""
    options: dict[str, Any]
    """``model``, ``device``, ``dtype``, ``quantization``, ``revision`` and ``extra`` (strings)."""

    @property
    def is_reference(self) -> bool:
        return self.engine == "qwen-tts"


@dataclass(frozen=True, slots=True)
class RunRecord:
    """One timed synthesis of one text by one configuration."""

    seq: int
    """Position in the interleaved schedule (0-based, across all configurations)."""
    config: str
    """Label of the configuration."""
    run: int
    """Run number, 0-based."""
    text_index: int
    size: str
    """``short``, ``medium`` or ``long``."""
    ok: bool
    ttfa_s: float = 0.0
    """Seconds from the synthesis call to the first audio chunk (the end, for qwen-tts)."""
    synth_s: float = 0.0
    """Seconds from the synthesis call to the last chunk."""
    audio_s: float = 0.0
    """Seconds of audio produced."""
    frames: float = 0.0
    """Codec frames produced (audio seconds x 12.5)."""
    chunks: int = 0
    peak_rss_mib: float = 0.0
    """Worker's resident-set high-water mark after this run, mebibytes."""
    device_peak_mib: float = 0.0
    error: str | None = None


@dataclass(slots=True)
class ConfigResult:
    """Everything measured for one configuration (filled in while the benchmark runs)."""

    spec: ConfigSpec
    ok: bool = True
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    load_s: float = 0.0
    """Seconds from building the engine (imports included) to the end of ``load_blocking``."""
    import_s: float = 0.0
    """The part of ``load_s`` spent importing the engine's libraries (``create_engine``)."""
    warmup_s: float = 0.0
    """Seconds for ``warmup_blocking``."""
    rss_before_load_mib: float = 0.0
    """Worker RSS with the libraries imported but no engine built, mebibytes."""
    streaming: bool = True
    versions: dict[str, str] = field(default_factory=dict)
    peak_rss_mib: float = 0.0
    """Worker's resident-set high-water mark over the whole benchmark (loading included), mebibytes."""
    rss_end_mib: float = 0.0
    """Worker's resident set after its last run (the model loaded, steady state), mebibytes."""
    device_kind: str = "none"
    device_peak_mib: float = 0.0
    """The framework's own peak (CUDA, MPS or MLX counters), mebibytes; 0 on a plain CPU."""
    records: list[RunRecord] = field(default_factory=list)

    def absorb_memory(self, reply: dict[str, Any]) -> None:
        if "rss_mib" in reply:
            self.rss_end_mib = float(reply["rss_mib"])
        self.peak_rss_mib = max(self.peak_rss_mib, float(reply.get("peak_rss_mib", 0.0)))
        self.device_peak_mib = max(self.device_peak_mib, float(reply.get("device_peak_mib", 0.0)))
        kind = str(reply.get("device_kind", "none"))
        if kind != "none":
            self.device_kind = kind

    def fail(self, error: str) -> None:
        self.ok = False
        self.error = self.error or error


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def percentiles(
    values: Sequence[float], qs: Sequence[float] = (50, 90, 99), ndigits: int | None = None
) -> dict[str, float]:
    """``{"p50": ..., "p90": ..., "p99": ..., "max": ...}`` of ``values`` (empty: ``{}``), rounded to
    ``ndigits`` when given."""
    if not values:
        return {}
    found = {f"p{q:g}": percentile(values, q) for q in qs}
    found["max"] = float(max(values))
    return found if ndigits is None else {k: round(v, ndigits) for k, v in found.items()}


def _stats(records: Sequence[RunRecord]) -> dict[str, float]:
    ttfa = [r.ttfa_s for r in records]
    synth = sum(r.synth_s for r in records)
    audio = sum(r.audio_s for r in records)
    frames = sum(r.frames for r in records)
    return {
        "ttfa_p50_ms": percentile(ttfa, 50) * 1000.0,
        "ttfa_p95_ms": percentile(ttfa, 95) * 1000.0,
        "synth_mean_s": synth / len(records),
        "synth_total_s": synth,
        "audio_total_s": audio,
        "rtf": synth / audio if audio > 0 else math.nan,
        "frames_per_s": frames / synth if synth > 0 else math.nan,
    }


def summarize(result: ConfigResult) -> dict[str, Any]:
    """The figures of one configuration (``None`` where nothing was measured)."""
    good = [r for r in result.records if r.ok]
    summary: dict[str, Any] = {
        "runs_ok": len(good),
        "runs_failed": len(result.records) - len(good),
        "load_s": result.load_s if result.info else None,
        "import_s": result.import_s if result.info else None,
        "warmup_s": result.warmup_s if result.info else None,
        "rss_before_load_mib": result.rss_before_load_mib or None,
        "peak_rss_mib": result.peak_rss_mib or None,
        "rss_end_mib": result.rss_end_mib or None,
        "device_kind": result.device_kind,
        "device_peak_mib": result.device_peak_mib,
    }
    if good:
        summary.update(_stats(good))
        summary["by_size"] = {
            size: _stats(subset)
            for size in ("short", "medium", "long")
            if (subset := [r for r in good if r.size == size])
        }
    return summary


RATIO_KEYS = (
    "rss_end_mib",
    "ttfa_p50_ms",
    "ttfa_p95_ms",
    "synth_total_s",
    "rtf",
    "frames_per_s",
    "load_s",
    "peak_rss_mib",
    "device_peak_mib",
)


def ratios(summary: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float | None]:
    """Each figure divided by the baseline's (None where either is missing, zero or NaN)."""
    out: dict[str, float | None] = {}
    for key in RATIO_KEYS:
        value, base = summary.get(key), baseline.get(key)
        if isinstance(value, float | int) and isinstance(base, float | int) and base != 0:
            ratio = float(value) / float(base)
            out[key] = None if math.isnan(ratio) else ratio
        else:
            out[key] = None
    return out


def baseline_index(results: Sequence[ConfigResult]) -> int | None:
    """The first configuration (the first that produced figures, if the first failed)."""
    for index, result in enumerate(results):
        if any(r.ok for r in result.records):
            return index
    return None


def build_document(
    results: Sequence[ConfigResult], texts: Sequence[BenchText], settings: dict[str, Any], machine: dict[str, Any]
) -> dict[str, Any]:
    """The JSON document: settings, machine, texts, one entry per configuration, every run."""
    summaries = [summarize(r) for r in results]
    base = baseline_index(results)
    configs = []
    for result, summary in zip(results, summaries, strict=True):
        configs.append(
            {
                "label": result.spec.label,
                "engine": result.spec.engine,
                "options": result.spec.options,
                "status": "ok" if result.ok else "error",
                "error": result.error,
                "streaming": result.streaming,
                "info": result.info,
                "versions": result.versions,
                "summary": summary,
                "ratios": ratios(summary, summaries[base]) if base is not None and result.records else None,
            }
        )
    runs = [asdict(record) for result in results for record in result.records]
    runs.sort(key=lambda record: record["seq"])
    return {
        "schema": SCHEMA,
        "machine": machine,
        "settings": settings,
        "baseline": results[base].spec.label if base is not None else None,
        "texts": [asdict(t) for t in texts],
        "configs": configs,
        "runs": runs,
        "recommendation": recommend(configs),
    }


_SECTION_KEYS = ("device", "dtype", "quantization", "kernels", "isa")
"""Options of a configuration that are keys of its engine's section (``tts.<engine>.<key>``)."""


def recommend(configs: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest configuration of this run (lowest real-time factor over every text, each run of it
    succeeded; the official package is not one the daemon can run), and the settings that select it."""
    fastest: dict[str, Any] | None = None
    for config in configs:
        summary = config["summary"]
        rtf = summary.get("rtf")
        if config["engine"] == "qwen-tts" or config["status"] != "ok" or summary.get("runs_failed"):
            continue
        if not summary.get("runs_ok") or rtf is None or math.isnan(rtf):
            continue
        if fastest is None or rtf < fastest["summary"]["rtf"]:
            fastest = config
    if fastest is None:
        return None
    engine, options = fastest["engine"], fastest["options"]
    settings = {"tts.engine": engine}
    section = engine if engine in ("torch", "mlx") else None
    for key in _SECTION_KEYS:
        if section is not None and key in options:
            settings[f"tts.{section}.{key}"] = str(options[key])
    settings.update({f"tts.options.{key}": str(value) for key, value in options.get("extra", {}).items()
                     if key != "max_frames"})  # fmt: skip
    return {
        "label": fastest["label"],
        "weights": fastest["info"].get("dtype"),
        "rtf": fastest["summary"]["rtf"],
        "of": sum(1 for c in configs if c["summary"].get("runs_ok")),
        "settings": settings,
    }


def render_recommendation(document: dict[str, Any]) -> str:
    """One line naming the fastest configuration and the settings that choose it; empty without one."""
    best = document.get("recommendation")
    if not best:
        return ""
    weights = f", weights {best['weights']}" if best.get("weights") else ""
    settings = ", ".join(f"{key}: {value}" for key, value in best["settings"].items())
    return (
        f"recommended for this machine: {best['label']} (RTF {best['rtf']:.2f}{weights}, the fastest of"
        f" {best['of']} measured here): {settings}\n"
    )


def _clean(value: Any) -> Any:
    """NaN becomes None so the JSON stays standard."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def write_json(document: dict[str, Any], path: Path) -> None:
    """Standard JSON (NaN written as null), UTF-8, indented."""
    text = json.dumps(_clean(document), indent=2, ensure_ascii=False, allow_nan=False)
    path.write_text(text + "\n", encoding="utf-8")


def _fmt(value: Any, spec: str, width: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-".rjust(width)
    return format(value, spec).rjust(width)


_COLUMNS: tuple[tuple[str, str, str, int], ...] = (
    # header, summary key, format, width
    ("load s", "load_s", ".1f", 7),
    ("TTFA p50 ms", "ttfa_p50_ms", ".0f", 12),
    ("p95 ms", "ttfa_p95_ms", ".0f", 8),
    ("synth s", "synth_mean_s", ".2f", 8),
    ("RTF", "rtf", ".2f", 6),
    ("frames/s", "frames_per_s", ".1f", 9),
    ("RSS MiB", "peak_rss_mib", ".0f", 8),
    ("end MiB", "rss_end_mib", ".0f", 8),
    ("dev MiB", "device_peak_mib", ".0f", 8),
)
_RATIO_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("xTTFA", "ttfa_p50_ms", 6),
    ("xRTF", "rtf", 6),
    ("xRSS", "peak_rss_mib", 6),
)


def _one_line(text: str | None, limit: int = 160) -> str:
    """An error message squeezed onto one table line (the JSON keeps it whole)."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def render_table(document: dict[str, Any]) -> str:
    """Fixed-width table of the document's configurations, with ratios to the baseline."""
    configs = document["configs"]
    label_width = min(40, max([13] + [len(c["label"]) for c in configs]))
    header = "configuration".ljust(label_width) + " " + "dtype".ljust(9)
    header += "".join(" " + name.rjust(width) for name, _, _, width in _COLUMNS)
    header += "".join(" " + name.rjust(width) for name, _, width in _RATIO_COLUMNS)
    lines = [header, "-" * len(header)]
    footnotes: list[str] = []
    for config in configs:
        label = config["label"][:label_width].ljust(label_width)
        summary = config["summary"]
        if config["status"] != "ok" and not summary.get("runs_ok"):
            lines.append(f"{label} ERROR: {_one_line(config['error'])}")
            continue
        dtype = str(config["info"].get("dtype", ""))[:9].ljust(9)
        cells = []
        for _, key, spec, width in _COLUMNS:
            cell = _fmt(summary.get(key), spec, width)
            if key == "device_peak_mib" and summary.get("device_kind", "none") == "none":
                cell = "-".rjust(width)
            if key in ("ttfa_p50_ms", "ttfa_p95_ms") and not config["streaming"]:
                cell = cell[1:] + "*"
            cells.append(cell)
        ratio = config["ratios"] or {}
        cells.extend(_fmt(ratio.get(key), ".2f", width) for _, key, width in _RATIO_COLUMNS)
        line = f"{label} {dtype} " + " ".join(cells)
        if config["status"] != "ok":
            line += f"  (partly failed: {_one_line(config['error'])})"
        elif summary.get("runs_failed"):
            line += f"  ({summary['runs_failed']} runs failed)"
        lines.append(line)
        if not config["streaming"] and "*" not in footnotes:
            footnotes.append("*")
    lines.append("")
    lines.extend(
        [
            "TTFA: time to the first audio chunk.  synth s: mean synthesis time per text.",
            "RTF: synthesis time / audio time (below 1 is faster than real time).",
            "frames/s: codec frames (12.5 per audio second) produced per second of synthesis.",
            "RSS MiB: peak resident memory of the configuration's own process (loading included); end MiB: its",
            "resident memory after the last run; dev MiB: the framework's own device peak (CUDA, MPS, MLX).",
            f"xTTFA, xRTF, xRSS: ratio to {document['baseline'] or 'the first configuration'} (below 1 is better).",
        ]
    )
    if footnotes:
        lines.append("* does not stream: its first audio arrives with its last, so TTFA is the whole synthesis.")
    return "\n".join(lines) + "\n"


def render_markdown(document: dict[str, Any]) -> tuple[str, str]:
    """The document's configurations as a Markdown table for the performance page, and its notes."""
    header = ["configuration", "dtype", *(name for name, _, _, _ in _COLUMNS), *(n for n, _, _ in _RATIO_COLUMNS)]
    rows: list[list[Any]] = []
    for config in document["configs"]:
        summary = config["summary"]
        if config["status"] != "ok" and not summary.get("runs_ok"):
            rows.append([config["label"], f"ERROR: {_one_line(config['error'], 80)}", *[None] * (len(header) - 2)])
            continue
        cells: list[Any] = [config["label"], config["info"].get("dtype")]
        for _, key, spec, _ in _COLUMNS:
            value = summary.get(key)
            if key == "device_peak_mib" and summary.get("device_kind", "none") == "none":
                value = None
            cell = _fmt(value, spec, 0).strip()
            if key in ("ttfa_p50_ms", "ttfa_p95_ms") and not config["streaming"] and cell != "-":
                cell += "\\*"
            cells.append(cell)
        ratio = config["ratios"] or {}
        cells.extend(_fmt(ratio.get(key), ".2f", 0).strip() for _, key, _ in _RATIO_COLUMNS)
        rows.append(cells)
    settings = document["settings"]
    notes = [
        f"{settings['runs']} runs over {len(document['texts'])} texts, {settings['chunk_frames']}-frame chunks,"
        f" max_frames {settings['max_frames'] or 'the engine budget'}, greedy, seed {settings['seed']}; model"
        f" `{settings['model']}`. TTFA: time to the first audio chunk; synth s: mean synthesis time per text;"
        " RTF: synthesis time / audio time (below 1 is faster than real time); frames/s: codec frames (12.5 per"
        " audio second) per second of synthesis; RSS MiB: peak resident memory of the configuration's own"
        " process, end MiB: after its last run; dev MiB: the framework's device peak.",
        f"xTTFA, xRTF, xRSS: ratio to {document['baseline'] or 'the first configuration'} (below 1 is better).",
    ]
    if any(not c["streaming"] for c in document["configs"]):
        notes.append("\\* does not stream: its first audio arrives with its last, so TTFA is the whole synthesis.")
    return markdown_table(header, rows, "ll" + "r" * (len(header) - 2)), "\n\n".join(notes)


def describe_machine(machine: dict[str, Any]) -> str:
    memory = f", {machine['memory_gib']} GiB RAM" if machine.get("memory_gib") else ""
    kernels = f", native kernels {machine['native_kernels']}" if machine.get("native_kernels") else ""
    return f"{machine['cpu']}, {machine['logical_cores']} logical cores{memory}, {machine['platform']}{kernels}"


def load_pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend; UnavailableError naming the extra when it cannot be imported.

    The bench command calls it before the first run, so a missing extra costs seconds, not the benchmark.
    """
    try:
        import matplotlib  # optional: the `bench` extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        msg = f"--png needs matplotlib, which cannot be imported ({exc}): pip install 's2s-daemon[bench]'"
        raise UnavailableError(msg) from exc
    return plt


def write_png(document: dict[str, Any], path: Path) -> None:
    """Bar charts of latency (TTFA p50/p95, RTF) and peak memory (RSS, device) per configuration."""
    plt = load_pyplot()

    configs = [c for c in document["configs"] if c["summary"].get("runs_ok")]
    labels = [c["label"] for c in configs]
    positions = list(range(len(configs)))
    p50 = [c["summary"]["ttfa_p50_ms"] or 0.0 for c in configs]
    p95 = [c["summary"]["ttfa_p95_ms"] or 0.0 for c in configs]
    rtf = [c["summary"]["rtf"] or 0.0 for c in configs]
    rss = [c["summary"]["peak_rss_mib"] or 0.0 for c in configs]
    rss_end = [c["summary"].get("rss_end_mib") or 0.0 for c in configs]
    device = [c["summary"]["device_peak_mib"] or 0.0 for c in configs]

    height = 1.2 + 0.45 * max(1, len(configs))
    fig, (ax_ttfa, ax_rtf, ax_mem) = plt.subplots(1, 3, figsize=(15, height + 1.2), sharey=True)
    width = 0.38
    ax_ttfa.barh([p - width / 2 for p in positions], p50, height=width, label="p50", color="#4c72b0")
    ax_ttfa.barh([p + width / 2 for p in positions], p95, height=width, label="p95", color="#9ab3d5")
    ax_ttfa.set_xlabel("time to first audio, ms (lower is better)")
    ax_ttfa.legend(loc="best", fontsize="small")
    ax_rtf.barh(positions, rtf, height=0.6, color="#55a868")
    ax_rtf.axvline(1.0, color="#c44e52", linestyle="--", linewidth=1)
    ax_rtf.set_xlabel("real-time factor (below the red line: faster than real time)")
    third = 0.27
    ax_mem.barh([p - third for p in positions], rss, height=third, label="peak RSS", color="#8172b2")
    ax_mem.barh(positions, rss_end, height=third, label="RSS after runs", color="#b3a8d6")
    if any(device):
        ax_mem.barh([p + third for p in positions], device, height=third, label="device peak", color="#ccb974")
    ax_mem.set_xlabel("memory, MiB")
    ax_mem.legend(loc="best", fontsize="small")
    ax_ttfa.set_yticks(positions)
    ax_ttfa.set_yticklabels(labels)
    ax_ttfa.invert_yaxis()
    for ax in (ax_ttfa, ax_rtf, ax_mem):
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"s2s-daemon bench: {describe_machine(document['machine'])}", fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_table(document: dict[str, Any], stream: TextIO) -> None:
    machine = document["machine"]
    load = machine.get("load_average")
    busy = f" (1-minute load average {load[0]:.1f} at start)" if load else ""
    stream.write(f"machine: {describe_machine(machine)}{busy}\n")
    stream.write(render_table(document))
    stream.write(render_recommendation(document))
    stream.flush()
