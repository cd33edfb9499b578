"""What ``symfuse inspect`` shows: the table (:func:`format_report`) and the figure (:func:`plot_report`)."""

from __future__ import annotations

from pathlib import Path

from symfuse.inspect.distances import ALL, MODULE_KINDS, RESIDUAL_KIND

SHORT = {"ffn-permutation": "ffn-perm", "head-permutation": "head-perm", "rotation": "+rotation",
         "scaling": "+scaling", RESIDUAL_KIND: "residual-orth"}  # fmt: skip
COLUMNS = (*MODULE_KINDS, RESIDUAL_KIND)  # "all" is each row's last kind


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def module_table(modules: list[dict], total: dict) -> list[str]:
    """Rows ``module before <each kind, added in turn> [residual-orth]`` of relative distances, the total last.

    ``-``: the kind does not act on that module.
    """
    cols = [k for k in COLUMNS if any(k in r["after"] for r in modules)]
    head = ["module", "before", *(SHORT.get(k, k) for k in cols)]
    rows = [[r["module"], _cell(r["before"]), *(_cell(r["after"].get(k)) for k in cols)] for r in modules]
    rows.append(["all modules", _cell(total["before"]), *(_cell(total["after"].get(k)) for k in cols)])
    widths = [max(len(row[i]) for row in (head, *rows)) for i in range(len(head))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in (head, *rows)]


def _paths(data: dict) -> list[str]:
    lam = "  ".join(f"{x:<6g}" for x in data["lambdas"])
    lines = [f"loss along the path ({data['loss']}, {data['examples']} examples of the {data['split']} split):",
             f"  λ        {lam}"]  # fmt: skip
    for name in ("plain", "aligned"):
        p = data[name]
        lines.append(f"  {name:<8} " + "  ".join(f"{x:<6.4g}" for x in p["losses"]))
    for name in ("plain", "aligned"):
        p, e = data[name], data[name]["ensemble"]
        lines.append(
            f"  {name}: barrier {p['barrier']:.4g} at λ={p['argmax_lambda']:g} ({p['rel_barrier']:.0%} of the end "
            f"loss); merge at λ=0.5 vs ensemble: top-1 agreement {e['top1_agreement']:.3f}, relative logit distance "
            f"{e['rel_logit_distance']:.3g}"
        )
    return lines


def format_pair(pair: dict) -> list[str]:
    """One pair's section: what it is, its module table, its whole-model figures, its paths and verdict."""
    lines = [f"{pair['model']} ({pair['family']}, {pair['shapes']})"]
    if not pair["compatible"]:
        return [*lines, f"verdict: {pair['verdict']} — {pair['reason']}"]
    lines.append("relative distance to the anchor |B-A|/|A|, before and after the kinds, added in turn:")
    lines += ["  " + row for row in module_table(pair["modules"], pair["total"])]
    model = pair["whole_model"]
    after = ", ".join(f"{k} {v:.3g}" for k, v in model["after"].items())
    rounds = f" ({model['residual_rounds']} rounds)" if model["residual_rounds"] else ""
    lines.append(f"whole model: before {model['before']:.3g}, after {after}{rounds}")
    if pair["left_out"]:
        lines.append(f"left out (heads of different shapes): {', '.join(pair['left_out'])}")
    if pair["data"]:
        lines += _paths(pair["data"])
    return [*lines, f"verdict: {pair['verdict']} — {pair['reason']}"]


def format_report(report: dict) -> str:
    """The whole report as text: the anchor, one section per model, the overall verdict last."""
    lines = [f"anchor: {report['anchor']} ({report['family']}, {report['shapes']}); device {report['device']}", ""]
    for pair in report["pairs"]:
        lines += [*format_pair(pair), ""]
    lines.append(f"verdict: {report['verdict']} — {report['reason']} ({report['seconds']:.1f} s)")
    return "\n".join(lines)


def plot_report(report: dict, file: Path) -> Path:
    """A PNG: per pair, the module distances before and after all kinds; with data, the loss along the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = [p for p in report["pairs"] if p["compatible"]]
    with_data = any(p["data"] for p in pairs)
    rows = max(1, len(pairs))
    fig, axes = plt.subplots(rows, 2 if with_data else 1, figsize=(10 if with_data else 6, 3.2 * rows), squeeze=False)
    for row, pair in zip(axes, pairs, strict=False):
        keys = [m["module"] for m in pair["modules"]]
        x = range(len(keys))
        row[0].bar([i - 0.2 for i in x], [m["before"] for m in pair["modules"]], 0.4, label="before")
        row[0].bar([i + 0.2 for i in x], [m["after"][ALL] for m in pair["modules"]], 0.4, label="after all kinds")
        row[0].set_xticks(list(x), keys, rotation=90, fontsize=6)
        row[0].set_ylabel("|B-A| / |A|")
        row[0].set_title(f"{Path(pair['model']).name}: {pair['verdict']}", fontsize=9)
        row[0].legend(fontsize=7)
        if with_data and pair["data"]:
            d = pair["data"]
            for name in ("plain", "aligned"):
                row[1].plot(d["lambdas"], d[name]["losses"], "o-", label=name)
            row[1].set_xlabel("λ")
            row[1].set_ylabel("loss")
            row[1].legend(fontsize=7)
    fig.tight_layout()
    file = Path(file)
    tmp = file.with_name(f".{file.name}.tmp")
    fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    tmp.replace(file)
    return file
