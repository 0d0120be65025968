"""The evaluation report: JSON file, text summary, Wilson intervals and the acceptance plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from peagle_train.evaluate.cost_model import format_cost_model
from stores.errors import ForeignFilesError, OutputExistsError
from stores.files import strict_json
from stores.staging import write_text_atomic


def write_json(report: dict[str, Any], path: str | Path) -> None:
    """Write ``report`` to ``path`` atomically, as strict JSON.

    Raises:
        NonFiniteError: a NaN or infinite value in the report (named by its key); nothing is written.
    """
    path = Path(path)
    text = strict_json(report, f"the evaluation report {path}", indent=2, default=str) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)


REPORT_KEYS = ("template_mode", "offline", "identical_to_greedy", "positions_scored")
"""Keys of which every report of peagle-eval holds at least one (how ``--force`` tells a report of its own)."""


def foreign_report_files(path: str | Path) -> list[Path]:
    """The files of the report ``path`` and its plot (``.png`` beside it) that peagle-eval did not write: both
    when ``path`` is no JSON object with one of :data:`REPORT_KEYS` (the plot is a report's only beside it)."""
    path = Path(path)
    existing = [p for p in (path, path.with_suffix(".png")) if p.exists() or p.is_symlink()]
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        report = None
    ours = isinstance(report, dict) and any(k in report for k in REPORT_KEYS)
    return [] if ours else existing


def check_report_output(output: str | None, force: bool) -> Path | None:
    """The report's path (None: none asked). Raises OutputExistsError when the report or its PNG exists and ``force``
    is not set, ForeignFilesError when ``force`` would replace files that are no report of peagle-eval's
    (:func:`foreign_report_files`)."""
    if output is None:
        return None
    for existing in (Path(output), Path(output).with_suffix(".png")):
        if existing.exists() and not force:
            raise OutputExistsError(str(existing))
    foreign = foreign_report_files(output)
    if foreign:
        raise ForeignFilesError(str(output), [str(p) for p in foreign], "--output", ["an evaluation report"])
    return Path(output)


def mode_name(kwargs: dict[str, Any]) -> str:
    """A template mode's name in reports: its variables as sorted JSON (``{}``: the template's defaults)."""
    return json.dumps(kwargs, sort_keys=True)


def per_mode_report(per_prompt: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The acceptance per template mode of an online report's ``per_prompt`` turns (each with
    ``chat_template_kwargs``, ``accepted``, ``drafted``, ``num_drafts``): ``{mode name: {"chat_template_kwargs",
    "prompts", "turns", "num_drafts", "drafted", "accepted", "acceptance_length" (1 + accepted / num_drafts),
    "acceptance_rate" (accepted / drafted, None without drafts)}}``, modes in order of first use. The counts
    are the per-request ones (for vLLM its per-step counts of each request), summed."""
    out: dict[str, dict[str, Any]] = {}
    prompts: dict[str, set] = {}
    for t in per_prompt:
        name = mode_name(t["chat_template_kwargs"])
        m = out.setdefault(name, {"chat_template_kwargs": t["chat_template_kwargs"], "prompts": 0, "turns": 0,
                                  "num_drafts": 0, "drafted": 0, "accepted": 0})
        prompts.setdefault(name, set()).add(t["prompt_id"])
        m["prompts"] = len(prompts[name])
        m["turns"] += 1
        for key in ("num_drafts", "drafted", "accepted"):
            m[key] += t[key]
    for m in out.values():
        m["acceptance_length"] = 1.0 + (m["accepted"] / m["num_drafts"] if m["num_drafts"] else 0.0)
        m["acceptance_rate"] = m["accepted"] / m["drafted"] if m["drafted"] else None
    return out


def count_of(n: int, noun: str) -> str:
    """``"1 block"``, ``"2 blocks"``: a count and its noun, plural unless the count is one (nouns taking -s)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)


def format_report(report: dict[str, Any]) -> str:
    """A readable table of an online and/or offline report (the ``offline`` key); the tokens/s of every
    measured concurrency (:func:`_throughput_lines`)."""
    lines: list[str] = []
    if "acceptance_length" in report:
        lines += [
            f"online: {report['num_prompts']} prompts, {report['num_turns']} turns, K={report['num_draft_tokens']}"
            + (f", tree {report['tree']} ({report.get('tree_nodes_verified')} nodes verified)" if report.get("tree")
               else ""),
            f"  acceptance length  {_fmt(report['acceptance_length'])}",
            f"  acceptance rate    {_fmt(report['acceptance_rate'])}  "
            f"({report['accepted']}/{report['drafted']})",
            *_throughput_lines(report),
            *([f"  acceptance         {report['acceptance_scheme']}"] if report.get("acceptance_scheme") else []),
            f"  identical to greedy {report['identical_to_greedy']}"
            + (f"  (temperature {report['temperature']}: sampled, not compared)" if report.get("temperature") else "")
            + (f"  ({report['near_tie_divergences']} turns diverge at a near tie of the verifier's top logits in "
               f"{(report.get('greedy_check') or {}).get('dtype')}: accepted)" if report.get("near_tie_divergences")
               else ""),
            f"  wall time          {_fmt(report.get('wall_time_s'))} s, {report.get('generated_tokens', '-')} tokens "
            "generated by speculative decoding",
        ]
        per_pos = report["per_position_acceptance"]
        lines += ([f"  per position       {report.get('per_position_note')}"] if per_pos is None else [
            "  position  " + " ".join(f"{i:>6d}" for i in range(len(per_pos))),
            "  accepted  " + " ".join(f"{_fmt(x):>6s}" for x in per_pos)])
        lines += _per_mode_lines(report.get("per_mode"))
        lines += _cost_lines(report)
    off = report.get("offline", report if "simulated_acceptance_length" in report or "replay" in report else None)
    if off:
        lines += [f"offline: {count_of(len(off.get('blocks', [])), 'block')} ({off.get('split', '-')}{_store_state(off)})"
                  + (f", {count_of(off['positions_scored'], 'position')}" if "positions_scored" in off else ""),
                  *_replay_lines(off.get("replay")), *_all_anchor_lines(off)]
        lines += _cost_lines(off)
    lines += _template_mode_lines(report.get("template_mode"))
    return "\n".join(lines)


def _all_anchor_lines(off: dict[str, Any]) -> list[str]:
    """The all-anchor diagnostic's lines (acceptance length, per-depth accuracy and conditional acceptance), or the
    line saying it was not asked for."""
    if "simulated_acceptance_length" not in off:
        return ["  all-anchor diagnostic: not computed (--all-anchor; it reads the verifier's output head)"]
    K = off["num_depths"]
    return [f"  all-anchor acceptance length (diagnostic) {_fmt(off['simulated_acceptance_length'])}",
            "  depth     " + " ".join(f"{i:>6d}" for i in range(K)),
            "  accuracy  " + " ".join(f"{_fmt(x):>6s}" for x in off["per_depth_accuracy"]),
            "  cond.acc  " + " ".join(f"{_fmt(x):>6s}" for x in off["per_position_acceptance"])]


def _per_mode_lines(per_mode: dict[str, Any] | None) -> list[str]:
    """One line per template mode of a mixture: its prompts, turns and acceptance."""
    if not per_mode:
        return []
    return ["  per template mode (the mixture, drawn per prompt)"] + [
        f"    {name}: {m['prompts']} prompts, {m['turns']} turns, acceptance length {_fmt(m['acceptance_length'])}, "
        f"rate {_fmt(m['acceptance_rate'])} ({m['accepted']}/{m['drafted']})" for name, m in per_mode.items()]


def _template_mode_lines(mode: dict[str, Any] | None) -> list[str]:
    """The chat template variables the prompts were rendered with; a mismatch allowed by
    --allow-template-mode-mismatch, named."""
    if not mode:
        return []
    kwargs = mode["chat_template_kwargs"]
    used = json.dumps(kwargs) if kwargs else "none (the template's defaults)"
    lines = [f"template mode: chat template kwargs {used}"]
    if mode.get("mixture"):
        lines.append(f"  drawn per prompt from --seed {mode.get('seed')}: {json.dumps(mode['mixture'])}")
    lines += [f"  WARNING: another mode than the drafter's (--allow-template-mode-mismatch): {m}"
              for m in mode.get("mismatches") or []]
    return lines


def engine_name(report: dict[str, Any]) -> str:
    """The online engine a report measured, as summaries and plots name it: ``vLLM`` or ``peagle`` (its own
    decoder, transformers)."""
    return "vLLM" if report.get("engine") == "vllm" else "peagle"


def _throughput_lines(report: dict[str, Any]) -> list[str]:
    """Tokens/s and speedup at every measured concurrency (``throughput``, ``--engine vllm``: 1 and
    ``--concurrency``), not only the first; peagle's own decoder measures concurrency 1 alone."""
    baseline = "plain sampling" if report.get("temperature") else "greedy"
    throughput = report.get("throughput") or {}
    if not throughput:
        return [f"  tokens/s           {_fmt(report['tokens_per_second'])} speculative, "
                f"{_fmt(report['baseline_tokens_per_second'])} {baseline} (speedup {_fmt(report['speedup'])})"]
    lines = [f"  tokens/s ({engine_name(report)}, per concurrency: requests running together)"]
    for n, t in sorted(throughput.items(), key=lambda item: int(item[0])):
        lines.append(f"    concurrency {int(n):<3d} {_fmt(t.get('speculative'))} speculative, {_fmt(t.get('plain'))} "
                     f"{baseline} (speedup {_fmt(t.get('speedup'))})")
    return lines


def _cost_lines(report: dict[str, Any]) -> list[str]:
    """The ``cost_model`` table of an online or offline report, or the reason it was skipped; none when absent."""
    cm = report.get("cost_model")
    if cm is None:
        return []
    if "skipped" in cm:
        return [f"K from measured costs: skipped ({cm['skipped']})"]
    return format_cost_model(cm)


def _replay_lines(replay: dict[str, Any] | None) -> list[str]:
    """The replayed acceptance of an offline report (``replay``), the primary figure of a judge store."""
    if not replay:
        return []
    if "skipped" in replay:
        return [f"  replayed acceptance length: skipped ({replay['skipped']})"]
    se = (f" ± {replay['se']:.3f} (SE, bootstrap over {count_of(replay['conversations'], 'conversation')})"
          if replay["se"] is not None else "")
    lines = [f"  replayed acceptance length {replay['acceptance_length']:.3f}{se}, "
             f"{count_of(replay['turns'], 'turn')}, "
             f"{replay['num_drafts']} steps with drafts",
             "  replayed  " + " ".join(f"{_fmt(x):>6s}" for x in replay["per_position_acceptance"])]
    for b in replay["by_context_length"]:
        span = f"[{b['from']}, {b['to']})" if b["to"] is not None else f"[{b['from']}, ...)"
        bse = f" ± {b['se']:.3f}" if b["se"] is not None else ""
        lines.append(f"    context {span:>16s}: AL {b['acceptance_length']:.3f}{bse} ({b['num_drafts']} steps)")
    if replay.get("refused_turns"):
        lines.append(f"  turns not walked (not what decoding produces): {replay['refused_turns']}")
    return lines


def _store_state(off: dict) -> str:
    """``"; incomplete store: 10 of 77 blocks done"`` when the offline store has blocks not extracted yet."""
    done, total = off.get("store_blocks_done"), off.get("store_blocks_total")
    return f"; incomplete store: {done} of {total} blocks done" if done is not None and done != total else ""


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float] | None:
    """Wilson score interval of a binomial proportion (Wilson, 1927; 95% for z = 1.96).

    Unlike ``p ± z·sqrt(p(1-p)/n)`` it stays inside [0, 1] and is honest for small ``trials`` and
    for ``p`` near 0 or 1 (0 of 10 gives [0, 0.278], not [0, 0]). None when ``trials`` is 0.
    """
    if trials <= 0:
        return None
    n, p = trials, successes / trials
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / denom
    # rounding can put a bound a few ulps past p when p is 0 or 1: the interval always holds p
    return max(0.0, min(p, center - half)), min(1.0, max(p, center + half))


def _plot_series(report: dict[str, Any]) -> list[tuple[str, list[int], list[int]]]:
    """``(label, successes [K], trials [K])`` per series: online per-position acceptance (the share of
    verifier steps with drafts whose draft i was kept, as vLLM counts it), offline conditional
    acceptance, offline per-depth accuracy."""
    series = []
    if "acceptance_length" in report and "per_position_reached" in report:
        label = f"online ({engine_name(report)}): share of verifier steps accepting draft i"
        if report.get("temperature"):  # the scheme decides the acceptance at T > 0: named in the legend
            label += f", T={report['temperature']:g}, {report.get('draft_sample_method')} drafts"
        series.append((label, report["per_position_accepted"], report["per_position_reached"]))
    off = report.get("offline")
    if off and "per_position_reached" in off:
        series.append(("offline: P(accept | earlier accepted)", off["per_position_accepted"],
                       off["per_position_reached"]))
        series.append(("offline: per-depth accuracy", off["per_depth_correct"], off["per_depth_weight"]))
    return series


def _plot_title(report: dict[str, Any]) -> str:
    lines = []
    if "acceptance_length" in report:
        lines.append(f"online: acceptance length {report['acceptance_length']:.3f} (K={report['num_draft_tokens']}, "
                     f"{report['num_turns']} turns, {report['num_drafts']} verifier steps with drafts)")
        speedups = [f"{t['speedup']:.3f}x at concurrency {n}" for n, t in
                    sorted((report.get("throughput") or {}).items(), key=lambda item: int(item[0]))
                    if t.get("speedup") is not None]
        if speedups:
            lines.append(f"{engine_name(report)} tokens/s speedup: {', '.join(speedups)}")
        elif report.get("speedup") is not None:
            lines.append(f"{engine_name(report)} tokens/s speedup: {report['speedup']:.3f}x")
        if report.get("acceptance_scheme"):
            lines.append(report["acceptance_scheme"])
    off = report.get("offline")
    if off:
        replayed = (off.get("replay") or {}).get("acceptance_length")
        if replayed is not None:
            lines.append(f"offline: replayed acceptance length {replayed:.3f}")
        if "simulated_acceptance_length" in off:
            lines.append(f"offline: all-anchor acceptance length (diagnostic) {off['simulated_acceptance_length']:.3f} "
                         f"({count_of(off['positions_scored'], 'position')}, "
                         f"{count_of(len(off.get('blocks', [])), 'block')})")
    return "\n".join(lines)


def write_acceptance_plot(report: dict[str, Any], path: str | Path) -> Path:
    """PNG of acceptance per draft position with 95% Wilson intervals and the count under each bar.

    Bars: online per-position acceptance (``report``'s own keys) and offline conditional acceptance
    (``report["offline"]``); points: offline per-depth accuracy. The title gives the acceptance
    lengths and the online run's ``acceptance_scheme`` (greedy verification, or rejection sampling at T with
    its ``draft_sample_method``, also named in the online legend at T > 0). An offline-only run passes
    ``{"offline": offline_report}``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _plot_series(report)
    K = max((len(t) for _, _, t in series), default=0)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * K + 2), 4.2))
    bars = [s for s in series if "accuracy" not in s[0]]
    width = 0.64 / max(len(bars), 1)  # the bars of a position span [-0.32, 0.32]; accuracy points at +0.42
    for j, (label, succ, trials) in enumerate(series):
        is_bar = "accuracy" not in label
        offset = (j - (len(bars) - 1) / 2) * width if is_bar else 0.42
        xs = [i + offset for i in range(len(trials))]
        p = [a / n if n else float("nan") for a, n in zip(succ, trials)]
        ci = [wilson_interval(a, n) for a, n in zip(succ, trials)]
        err = [[max(0.0, v - c[0]) if c else 0.0 for v, c in zip(p, ci)],  # max: rounding at p = 0 or 1
               [max(0.0, c[1] - v) if c else 0.0 for v, c in zip(p, ci)]]
        if is_bar:
            ax.bar(xs, [0 if n == 0 else v for v, n in zip(p, trials)], width=width * 0.95, label=label,
                   yerr=err, capsize=3, color=f"C{j}", ecolor="0.3")
            for x, n, c in zip(xs, trials, ci):
                ax.annotate(f"n={n}", (x, c[1] if c else 0.0), xytext=(0, 3), textcoords="offset points",
                            ha="center", fontsize=7, color="0.25")
        else:
            ax.errorbar(xs, p, yerr=err, fmt="kD", ms=4, capsize=3, label=label)
    ax.set_xticks(range(K))
    ax.set_xlim(-0.6, max(K, 1) - 0.4)
    ax.set_ylim(0, 1.08)
    ax.set_xlabel("draft position (0 = first drafted token)")
    ax.set_ylabel("fraction (whiskers: 95% Wilson interval)")
    ax.set_title(_plot_title(report) or "no acceptance data", fontsize=9)
    fig.tight_layout()
    if series:  # below the axes, so it never hides a bar
        fig.subplots_adjust(bottom=0.24)
        fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=7, frameon=False)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
