"""What the eval suite writes: one results JSON, a Markdown table and a PNG bar chart side by side,
and the one-line summaries the CLI prints."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

from lit_softmoe.utils.atomic import replacing

_COLUMNS = ("top1", "top5", "mean_per_class_recall", "image_to_text_R@1", "image_to_text_R@5",
            "text_to_image_R@1", "text_to_image_R@5")


def summary_line(entry: dict) -> str:
    if entry["status"] != "ok":
        return f"{entry['benchmark']}: {entry['status']} ({entry['reason']})"
    metrics = ", ".join(f"{k} {percent(v)}" for k, v in entry["metrics"].items())
    line = f"{entry['benchmark']}: {metrics} ({entry['num_samples']} images, " \
           f"{entry['seconds']:.1f} s, image cache {entry['image_cache']})"
    return f"{line}; PARTIAL: {entry['partial']}" if entry.get("partial") else line


def percent(value) -> str:
    """A metric (a fraction) as the tables show it: a percentage with 2 decimals; anything else as
    it is."""
    return (f"{100 * value:.2f}" if isinstance(value, (int, float)) and not isinstance(value, bool)
            else str(value))


def markdown_row(cells: list[str]) -> str:
    """One table row from its cells. Rows are built as lists and joined last: joining an empty list
    of metric columns in the middle of a row (nothing ran) would add a phantom cell."""
    return "| " + " | ".join(cells) + " |"


def markdown_separator(aligns: list[str]) -> str:
    return "|" + "".join(f"{align}|" for align in aligns)


def markdown_table(report: dict) -> str:
    present = {k for e in report["results"] if e["status"] == "ok" for k in e["metrics"]}
    columns = [c for c in _COLUMNS if c in present] + sorted(present - set(_COLUMNS))
    lines = [f"Zero-shot results of `{report['model']}` on suite `{report['suite']}` "
             f"({report['device']})", "",
             markdown_row(["benchmark", "task", *columns, "samples", "templates", "seconds"]),
             markdown_separator(["---", "---", *["---:"] * len(columns), "---:", "---", "---:"])]
    for entry in report["results"]:
        if entry["status"] != "ok":
            lines.append(markdown_row([entry["benchmark"], entry["task"], *[""] * len(columns), "",
                                       f"{entry['status']}: {entry['reason']}".replace("|", "\\|"),
                                       ""]))
            continue
        cells = [percent(entry["metrics"][c]) if c in entry["metrics"] else "–" for c in columns]
        templates = entry.get("templates") or {}
        used = (f"{templates['from']} ×{templates['count']}"
                + (" (borrowed)" if templates.get("borrowed") else "")
                if templates else "captions")
        samples = (f"{entry['num_samples']} (partial)" if entry.get("partial")
                   else str(entry["num_samples"]))
        lines.append(markdown_row([entry["benchmark"], entry["task"], *cells, samples, used,
                                   f"{entry['seconds']:.1f}"]))
    return "\n".join(lines) + "\n"


def plot_report(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    bars = []
    for entry in report["results"]:
        if entry["status"] == "ok":
            for key in ("top1", "image_to_text_R@1", "text_to_image_R@1"):
                if key in entry["metrics"]:
                    bars.append((f"{entry['benchmark']}\n{key}", 100 * entry["metrics"][key]))
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(bars) + 1), 3.5))
    ax.bar(range(len(bars)), [v for _, v in bars], color="#4c72b0")
    for i, (_, value) in enumerate(bars):
        ax.text(i, value + 1, f"{value:.1f}", ha="center", fontsize=8)
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
    ax.set_ylim(0, 105)
    ax.set_ylabel("%")
    ax.set_title(f"zero-shot: suite {report['suite']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(report: dict, out: Path) -> None:
    """JSON, Markdown and PNG side by side, as one unit: all three are written to temporary files,
    then renamed into place (the JSON last); on any failure the ones already renamed are removed, so
    the set is at its final names whole or not at all."""
    renamed: list[Path] = []

    # runs after `final`'s rename, told whether it (and all before it) succeeded
    def mark(final: Path):
        return lambda exc_type, *_: renamed.append(final) if exc_type is None else None

    try:
        with contextlib.ExitStack() as stack:
            temporaries = []
            # renamed in reverse order
            for final in (out, out.with_suffix(".md"), out.with_suffix(".png")):
                stack.push(mark(final))
                temporaries.append(stack.enter_context(replacing(final)))
            results, table, chart = temporaries
            table.write_text(markdown_table(report), encoding="utf-8")
            plot_report(report, chart)
            results.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    except BaseException:
        for final in renamed:
            final.unlink(missing_ok=True)
        raise
