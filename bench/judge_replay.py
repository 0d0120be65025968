"""Several drafters judged side by side by replay on one judge set (``scripts/judge_set.py``): each drafter's
replayed AL per suite and temperature with its bootstrap SE over prompts (a prompt's T = 1 samples resampled together),
and its paired difference against the first drafter (the same prompts resampled for both; docs/guide-evaluation.md, "Judging drafters by
replay").

    python bench/judge_replay.py --judge judge --drafters RUN_A/final RUN_B/final [--output judge.json]

Each store is walked with the ``max_new_tokens`` it was generated with (its ``SUITE-RUN.done.json``); T = 1's seeded samples of a
suite are pooled (each sample its own conversations). Prints a markdown table on stdout (and the JSON to
``--output``); progress on stderr. Refused (exit 1, naming the store): an incomplete store, a store with turns
the replay cannot walk (``--allow-refused-turns``), and a store holding conversations a drafter was trained on
(``--allow-contaminated``; ``peagle_train.evaluate.offline.judge_problems``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from peagle_train.evaluate.offline import judge_problems, run_offline_eval
from peagle_train.evaluate.replay import bootstrap_al, paired_al_difference


def judge_groups(judge: Path) -> dict[str, list[Path]]:
    """``{"SUITE T=t": [stores]}`` of the finished stores (``SUITE-T0.zarr``, ``SUITE-T1-seedS.zarr``)."""
    groups: dict[str, list[Path]] = {}
    for done in sorted(judge.glob("*.done.json")):
        store = done.with_name(done.name[:-len(".done.json")] + ".zarr")
        suite, run = store.name[:-len(".zarr")].split("-T", 1)
        groups.setdefault(f"{suite} T={run.split('-')[0]}", []).append(store)
    return groups


def pooled(reports: list[tuple[str, dict]]) -> dict[str, np.ndarray]:
    """Per-conversation counts of several stores' replay reports, keys ``STORE:conversation``, sorted, with each
    conversation's prompt (``prompt``: the bootstrap's unit, so that the T = 1 samples of one prompt, each in its
    own store, are resampled together; a report without prompt keys counts each conversation as its own prompt).
    """
    rows = []
    for name, r in reports:
        pc = r["per_conversation"]
        prompts = pc.get("prompt") or [f"{name}:{c}" for c in pc["conversation"]]
        rows += [(f"{name}:{c}", str(p), a, d) for c, p, a, d in zip(pc["conversation"], prompts, pc["accepted"],
                                                                      pc["num_drafts"])]
    rows.sort()
    return {"keys": np.array([k for k, _, _, _ in rows]), "prompts": np.array([p for _, p, _, _ in rows]),
            "accepted": np.array([a for _, _, a, _ in rows], np.int64),
            "num_drafts": np.array([d for _, _, _, d in rows], np.int64)}


def judge(drafters: list[str], groups: dict[str, list[Path]], seed: int, allow_contaminated: bool = False,
          allow_refused_turns: bool = False) -> dict:
    """Every drafter's replayed AL per group, and its paired difference against ``drafters[0]``.

    Raises:
        SystemExit: a store that cannot stand as a judge figure (:func:`judge_problems`: no walkable turn, turns
        not walked, conversations the drafter was trained on), or two drafters whose conversations differ.
    """
    out = {}
    for group, stores in groups.items():
        per = {}
        for d in drafters:
            reports = []
            for store in stores:
                made = json.loads(store.with_name(store.name[:-len(".zarr")] + ".done.json").read_text())
                full = run_offline_eval(d, store, max_new_tokens=int(made["max_new_tokens"]), seed=seed)
                problems = judge_problems(full, allow_contaminated, allow_refused_turns)
                if problems:
                    raise SystemExit(f"judge_replay: {store} judging {d}: {'; '.join(problems)} (to judge anyway: "
                                     "--allow-refused-turns, --allow-contaminated)")
                reports.append((store.name, full["replay"]))
            per[d] = pooled(reports)
            print(f"judge_replay: {group}: {d} done", file=sys.stderr)
        base = per[drafters[0]]
        rows = {}
        for d, p in per.items():
            if not np.array_equal(p["keys"], base["keys"]):
                raise SystemExit(f"judge_replay: {group}: {d} walked other conversations than {drafters[0]}")
            al, se = bootstrap_al(p["accepted"], p["num_drafts"], seed=seed, clusters=p["prompts"])
            rows[d] = {"acceptance_length": al, "se": se, "conversations": int(p["keys"].size),
                       "prompts": int(np.unique(p["prompts"]).size),
                       "vs_first": None if d == drafters[0] else paired_al_difference(
                           base["accepted"], base["num_drafts"], p["accepted"], p["num_drafts"], seed=seed,
                           clusters=base["prompts"])}
        out[group] = rows
    return out


def table(result: dict, drafters: list[str]) -> str:
    """Markdown: one row per drafter, per group its AL ± SE and the paired Δ against the first drafter."""
    groups = list(result)
    head = ["drafter", *[f"{g} AL" for g in groups], *[f"Δ {g} vs first" for g in groups]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d in drafters:
        cells = [d]
        for g in groups:
            r = result[g][d]
            cells.append(f"{r['acceptance_length']:.3f}" + (f" ± {r['se']:.3f}" if r["se"] is not None else ""))
        for g in groups:
            v = result[g][d]["vs_first"]
            cells.append("" if v is None else f"{v['difference']:+.3f}" + (
                f" ± {v['se']:.3f}" if v["se"] is not None else "") + f" (n={v['conversations']})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--judge", type=Path, required=True)
    ap.add_argument("--drafters", nargs="+", required=True)
    ap.add_argument("--seed", type=int, default=0, help="the bootstrap's seed")
    ap.add_argument("--output", type=Path, default=None)
    ap.add_argument("--allow-contaminated", action="store_true",
                    help="judge a drafter on conversations it was trained on (its AL there is of memorised data)")
    ap.add_argument("--allow-refused-turns", action="store_true",
                    help="judge on the walkable turns when the replay refuses some (their AL alone)")
    a = ap.parse_args()
    groups = judge_groups(a.judge)
    if not groups:
        ap.error(f"{a.judge} holds no finished judge store (SUITE-T0.done.json): run scripts/judge_set.py")
    result = judge(a.drafters, groups, a.seed, a.allow_contaminated, a.allow_refused_turns)
    if a.output:
        a.output.write_text(json.dumps(result, indent=1))
    print(table(result, a.drafters))


if __name__ == "__main__":
    main()
