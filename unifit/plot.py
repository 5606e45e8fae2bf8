"""`unifit plot RUN_DIR [RUN_DIR ...] -o curves.png`: the curves of one or more runs, overlaid.

Reads each run directory's `metrics.jsonl` (one JSON line per epoch, written by rank 0, and one per
validation inside an epoch, marked `"mid_epoch": true`, drawn at its step; see callbacks/run_directory.py)
from a local path or any fsspec URL (s3://...), and draws one row of panels per quantity: the loss (train solid, validation dashed), every other train/val metric the
same way, the learning rate, and the throughput; the left column against the global step, the
right against wall time. Runs are told apart by colour and labelled by their directory name (or
`--label`).

Wall time: metrics.jsonl records no clock, so the time of each epoch comes from the run's
TensorBoard event files, inside the run directory (the default, `<root_dir>/tensorboard`, synced
there when root_dir is a URL) or where its config.yaml names them by an absolute path or URL: the
wall time of the event written at that epoch's end (the one with the same step and values, so
event files of other runs in the same directory are ignored), counted from the first event of
the file holding the first epoch (written when training started; a resumed run's later epochs
count the time it was stopped). A run without event files has no wall-time curves; an
`elapsed_s` field in metrics.jsonl, where present, is used as it is.

The output format follows the file name: .png (default), .svg, .pdf, or .html (the PNG embedded
in a page with a table of each run's last and best values). Matplotlib draws headless (Agg).
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Sequence

from unifit.errors import ConfigError, MissingExtraError, first_line
from unifit.loop.validations import MID_EPOCH

METRICS_FILE = "metrics.jsonl"
_NOT_PLOTTED = {"epoch", "step", "elapsed_s", MID_EPOCH}
_FORMATS = {".png", ".svg", ".pdf", ".html"}
_ROW_PX, _WIDTH_PX = 260, 1400  # default size: 1400 px wide, 260 px per row of panels


@dataclass
class Run:
    label: str
    url: str
    records: list[dict[str, Any]]
    elapsed: list[float | None] = field(default_factory=list)  # seconds since the start, per record

    @property
    def has_time(self) -> bool:
        return any(t is not None for t in self.elapsed)


# ---- reading ------------------------------------------------------------------------------------
def read_run(url: str, label: str | None = None, storage_options: dict[str, Any] | None = None) -> Run:
    """One run directory: its metrics.jsonl and, for wall time, its TensorBoard event files."""
    from unifit.storage import filesystem

    fs, root = filesystem(url, storage_options)
    root = root.rstrip("/") or root
    path = f"{root}/{METRICS_FILE}"
    shown = f"{url.rstrip('/')}/{METRICS_FILE}"
    try:
        if not fs.exists(root):
            raise ConfigError(f"unifit plot: run directory '{url}' does not exist; pass a run's trainer.root_dir")
        if not fs.exists(path):
            raise ConfigError(
                f"unifit plot: '{shown}' not found: '{url}' is not a unifit run directory "
                "(trainer.root_dir), or no epoch has finished there yet"
            )
        text = fs.cat_file(path).decode("utf-8", errors="replace")
    except ConfigError:
        raise
    except Exception as exc:  # credentials, endpoint, permissions: name the path, in one line
        raise ConfigError(f"unifit plot: cannot read '{shown}': {type(exc).__name__}: {first_line(exc)}") from None
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"unifit plot: '{shown}' line {number} is not JSON ({exc.msg}); is it a unifit metrics file?"
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ConfigError(
                f"unifit plot: '{shown}' line {number} has no integer 'step'; is it a unifit metrics file?"
            )
        records.append(record)
    if not records:
        raise ConfigError(f"unifit plot: '{shown}' is empty: no epoch of that run has finished yet")
    run = Run(label=label or _name(root), url=url, records=records)  # root: '.' resolved to its name
    run.elapsed = _elapsed(fs, root, records)
    return run


def _name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1] or path


def _elapsed(fs: Any, root: str, records: list[dict[str, Any]]) -> list[float | None]:
    if all(isinstance(r.get("elapsed_s"), (int, float)) for r in records):
        return [float(r["elapsed_s"]) for r in records]
    try:
        events = _epoch_events(fs, root)
    except Exception:  # unreadable or foreign event files: no wall time, the step curves still come
        return [None] * len(records)
    start, times = None, []
    for record in records:
        match = max(
            (e for e in events if e[2] == record["step"] and _same_values(e[3], record)),
            key=lambda e: e[1],
            default=None,
        )  # a step logged twice (resumed run): the latest
        if match is not None and start is None:
            start = match[0]  # the start of the file holding the first epoch: when training began
        times.append(None if match is None or start is None else match[1] - start)
    return times


def _same_values(scalars: dict[str, float], record: dict[str, Any]) -> bool:
    """The event was written at this record's epoch end, by this run: its scalars (float32) are the record's."""
    common = [k for k in scalars if _number(record.get(k)) is not None]
    return bool(common) and all(
        math.isclose(scalars[k], record[k], rel_tol=1e-5, abs_tol=1e-6)
        or math.isnan(scalars[k])
        and math.isnan(record[k])
        for k in common
    )


def _event_dirs(fs: Any, root: str) -> list[str]:
    """The run directory, and the TensorBoard directory its config.yaml names when that is an
    absolute path or URL elsewhere (a relative one was relative to the training's working directory)."""
    dirs = [root]
    try:
        from unifit.config.loading import parse_yaml

        board = parse_yaml(fs.cat_file(f"{root}/config.yaml").decode())["trainer"]["tensorboard"]
        named = board.get("sync_to") or board.get("log_dir")
    except Exception:
        return dirs
    if isinstance(named, str) and ("://" in named or os.path.isabs(named)):
        other_fs, other = fs, named
        if "://" in named:
            from unifit.storage import filesystem

            other_fs, other = filesystem(named, getattr(fs, "storage_options", None))
        if other_fs is fs and (other.rstrip("/") + "/").startswith(root.rstrip("/") + "/"):
            return dirs
        dirs.append((other_fs, other.rstrip("/")))  # type: ignore[arg-type]
    return dirs


def _epoch_events(fs: Any, root: str) -> list[tuple[float, float, int, dict[str, float]]]:
    """(start of its file, wall time, step, scalars) of every epoch-end event of the run's event files.

    Event files are TFRecord files: per record a little-endian u64 length, a u32 CRC, the
    serialized Event, a u32 CRC. A file's first event is written when its writer opens (training
    starts, or resumes); epoch-end events carry the `epoch` scalar (loggers/tensorboard.py).
    """
    from tensorboard.compat.proto.event_pb2 import Event  # protobuf only, no TensorFlow

    found = []
    for place in _event_dirs(fs, root):
        place_fs, place_root = place if isinstance(place, tuple) else (fs, place)
        for name in sorted(place_fs.glob(f"{place_root}/**/events.out.tfevents.*")):
            data, offset, file_start = place_fs.cat_file(name), 0, None
            while offset + 12 <= len(data):
                (length,) = struct.unpack_from("<Q", data, offset)
                event = Event.FromString(data[offset + 12 : offset + 12 + length])
                offset += 12 + length + 4
                file_start = event.wall_time if file_start is None else file_start
                scalars = {v.tag: v.simple_value for v in event.summary.value}
                if "epoch" in scalars:
                    found.append((file_start, event.wall_time, event.step, scalars))
    return found


# ---- drawing ------------------------------------------------------------------------------------
def panels(runs: Sequence[Run]) -> list[tuple[str, list[str]]]:
    """[(panel title, [metric keys drawn in it])]: loss first, then the other train/val metrics,
    then the learning rate, the throughput, and anything else."""
    keys: list[str] = []
    for run in runs:
        for record in run.records:
            keys += [k for k, v in record.items() if k not in keys and k not in _NOT_PLOTTED and _number(v) is not None]
    groups: dict[str, list[str]] = {}
    for key in keys:
        section, _, name = key.partition("/")
        if section in ("train", "val") and name:
            title = name
        elif key == "lr" or key.startswith(("lr/", "lr_")):
            title = "lr"
        else:
            title = key
        groups.setdefault(title, []).append(key)

    def order(title: str) -> tuple[int, str]:
        if title == "loss":
            return (0, title)
        if all(k.startswith(("train/", "val/")) for k in groups[title]):
            return (1, title)
        return (2, title) if title == "lr" else (3, title) if title.startswith("throughput") else (4, title)

    return [
        (title, sorted(groups[title], key=lambda k: (not k.startswith("train/"), k)))
        for title in sorted(groups, key=order)
    ]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _style(key: str) -> str:
    return "--" if key.startswith("val/") else "-"


def _time_unit(runs: Sequence[Run]) -> tuple[str, float]:
    longest = max((t for run in runs for t in run.elapsed if t is not None), default=0.0)
    return ("h", 3600.0) if longest > 3 * 3600 else ("min", 60.0) if longest > 600 else ("s", 1.0)


def render(
    runs: Sequence[Run], *, width_px: int | None = None, height_px: int | None = None, dpi: int = 100, fmt: str = "png"
) -> bytes:
    """The figure as PNG/SVG/PDF bytes, exactly width_px x height_px (defaults follow the rows)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingExtraError(
            f"unifit plot needs matplotlib, which is not importable ({exc}); fix: pip install 'unifit[plot]'"
        ) from exc
    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    rows = panels(runs)
    if not rows:
        raise ConfigError("unifit plot: no numeric metrics in " + ", ".join(f"'{r.url}'" for r in runs))
    timed = any(run.has_time for run in runs)
    width_px = width_px or _WIDTH_PX
    height_px = height_px or (_ROW_PX * len(rows) + 90)
    fig = Figure(figsize=((width_px + 0.01) / dpi, (height_px + 0.01) / dpi), dpi=dpi, layout="constrained")
    axes = fig.subplots(len(rows), 2 if timed else 1, squeeze=False)
    colors = matplotlib.colormaps["tab10"].colors
    unit, scale = _time_unit(runs)
    for row, (title, keys) in enumerate(rows):
        for column, ax in enumerate(axes[row]):
            for index, run in enumerate(runs):
                color = colors[index % len(colors)]
                for key in keys:
                    points = [
                        (r["step"] if column == 0 else t / scale, _number(r.get(key)))
                        for r, t in zip(run.records, run.elapsed)
                        if column == 0 or t is not None
                    ]
                    points = [(x, y) for x, y in points if y is not None]
                    if points:
                        xs, ys = zip(*points)
                        ax.plot(xs, ys, _style(key), color=color, marker="o", markersize=3, linewidth=1.5)
            ax.set_title(keys[0] if len(keys) == 1 else f"{title}: {', '.join(keys)}", fontsize=9, loc="left")
            ax.set_ylabel(title, fontsize=8)
            ax.tick_params(labelsize=8)
            ax.grid(True, alpha=0.3)
            ax.set_xlim(left=0)
            if row == len(rows) - 1:
                ax.set_xlabel("step" if column == 0 else f"wall time ({unit})", fontsize=9)
    handles = [
        Line2D([], [], color=colors[i % len(colors)], linewidth=2, label=run.label) for i, run in enumerate(runs)
    ]
    if any(k.startswith("val/") for _, keys in rows for k in keys):
        handles += [
            Line2D([], [], color="black", linestyle="-", label="train"),
            Line2D([], [], color="black", linestyle="--", label="val"),
        ]
    fig.legend(handles=handles, loc="outside upper center", ncols=min(len(handles), 6), fontsize=9, frameon=False)
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, dpi=dpi)
    return buffer.getvalue()


def render_html(runs: Sequence[Run], png: bytes) -> bytes:
    """A self-contained page: the PNG and, per run, the last epoch's value of each metric and the best validation
    value (of every validation, those inside epochs too)."""
    keys = [k for _, ks in panels(runs) for k in ks]
    head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
    body = []
    for run in runs:
        last = next((r for r in reversed(run.records) if not r.get(MID_EPOCH)), run.records[-1])
        cells = []
        for key in keys:
            values = [v for v in (_number(r.get(key)) for r in run.records) if v is not None and not math.isnan(v)]
            best = (min if "loss" in key else max)(values) if values and key.startswith("val/") else None
            value = _number(last.get(key))
            cells.append(
                f"<td>{'' if value is None else f'{value:.4g}'}{'' if best is None else f' (best {best:.4g})'}</td>"
            )
        body.append(
            f"<tr><td>{html.escape(run.label)}</td><td>{html.escape(run.url)}</td>"
            f"<td>{last.get('epoch', '')}</td><td>{last['step']}</td>{''.join(cells)}</tr>"
        )
    image = base64.b64encode(png).decode()
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>unifit runs</title>"
        "<style>body{font-family:sans-serif}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px}</style></head><body>"
        f"<h1>unifit runs</h1><img alt='training curves' src='data:image/png;base64,{image}'>"
        f"<h2>Last epoch (best validation value)</h2><table><tr><th>run</th><th>directory</th><th>epoch</th>"
        f"<th>step</th>{head}</tr>{''.join(body)}</table></body></html>\n"
    ).encode()


# ---- the command ------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (trainer.root_dir): paths or URLs")
    parser.add_argument(
        "-o", "--output", default="curves.png", help="output file: .png, .svg, .pdf or .html (default curves.png)"
    )
    parser.add_argument(
        "--label",
        action="append",
        default=None,
        help="a run's label, once per RUN_DIR in order (default: its directory name)",
    )
    parser.add_argument(
        "--size", default=None, help="image size in pixels, WIDTHxHEIGHT (default 1400 wide, 260 per row)"
    )
    parser.add_argument("--dpi", type=int, default=100)
    parser.add_argument(
        "--storage-options", default="{}", help="fsspec options as YAML/JSON, e.g. '{endpoint_url: http://...}'"
    )


def run_command(args: argparse.Namespace, extra: Sequence[str]) -> int:
    import yaml

    from unifit.config.loading import parse_yaml
    from unifit.storage import filesystem

    try:
        options = parse_yaml(args.storage_options) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"unifit plot: --storage-options {args.storage_options!r} is not YAML/JSON: {first_line(exc)}"
        ) from None
    if extra or not isinstance(options, dict):
        raise ConfigError(
            f"unifit plot: unexpected arguments {list(extra) or args.storage_options!r}; usage: "
            "unifit plot RUN_DIR [RUN_DIR ...] [-o curves.png] [--label L ...] [--size WxH] [--storage-options '{...}']"
        )
    if args.label is not None and len(args.label) != len(args.runs):
        raise ConfigError(
            f"unifit plot: {len(args.label)} --label for {len(args.runs)} run directories; "
            "give one --label per RUN_DIR, or none"
        )
    fmt = os.path.splitext(args.output)[1].lower()
    if fmt not in _FORMATS:
        raise ConfigError(
            f"unifit plot: -o '{args.output}': unknown format; end the name with {', '.join(sorted(_FORMATS))}"
        )
    width = height = None
    if args.size:
        try:
            width, height = (int(n) for n in args.size.lower().split("x"))
        except ValueError:
            width = height = 0
        if width <= 0 or height <= 0:
            raise ConfigError(f"unifit plot: --size '{args.size}': expected WIDTHxHEIGHT in pixels, e.g. 1600x1200")
    if args.dpi <= 0:
        raise ConfigError(f"unifit plot: --dpi {args.dpi}: must be > 0")
    runs = [read_run(url, (args.label or [None] * len(args.runs))[i], options) for i, url in enumerate(args.runs)]
    _disambiguate(runs, labelled=args.label is not None)
    png_or_doc = render(runs, width_px=width, height_px=height, dpi=args.dpi, fmt="png" if fmt == ".html" else fmt[1:])
    data = render_html(runs, png_or_doc) if fmt == ".html" else png_or_doc
    fs, path = filesystem(args.output, options)
    try:
        parent = os.path.dirname(path)
        if parent and not fs.exists(parent):
            fs.makedirs(parent, exist_ok=True)
        fs.pipe_file(path, data)
    except Exception as exc:
        raise ConfigError(
            f"unifit plot: cannot write '{args.output}': {type(exc).__name__}: {first_line(exc)}"
        ) from None
    untimed = [run.label for run in runs if not run.has_time]
    note = (
        f"; no wall time for {', '.join(untimed)} (no TensorBoard event files in the run directory)" if untimed else ""
    )
    print(f"unifit: wrote {args.output} ({len(runs)} run{'s' * (len(runs) > 1)}){note}", flush=True)
    return 0


def _disambiguate(runs: list[Run], labelled: bool) -> None:
    """Two runs named alike (a/run, b/run) are labelled by their last two path parts."""
    if labelled:
        return
    names = [run.label for run in runs]
    for run in runs:
        if names.count(run.label) > 1:
            parts = run.url.rstrip("/").rsplit("/", 2)
            run.label = "/".join(parts[-2:])
