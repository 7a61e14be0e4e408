"""What this folder's measured calibration would change: the time model's tokens/s per GPU for every H200 case of
pretrain/layout/calibration/checks.json, with (a) the committed pretrain/layout/calibration/h200.json and (b) that
table with the entries this run measured merged in (nothing is written into pretrain/). CPU, a few seconds.

    python benchmarks/results/layout_calibration_h200/compare_tables.py [--write-merged /tmp/h200_merged.json]
    python benchmarks/results/layout_calibration_h200/compare_tables.py --entries collective.busbw_fraction_intra \
        --out comparison_busbw_only.json    # (b) from some of the measured entries only

Also: (b) with the entries fitted to one run each (step.fixed_s, the TP and EP overheads, cp.merged_over_ideal)
fitted again as benchmarks/layout_calibration_results.py fits them, and (a) with one measured
entry at a time, which says what each entry moves. Writes comparison.json (--out) beside this file.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from pretrain.layout.calibration import Calibration, calibration_path  # noqa: E402
from pretrain.layout.calibration.checks import load_checks, predict  # noqa: E402

TARGET = 0.15


def merged(base, measured, keys):
    t = copy.deepcopy(base)
    for k in keys:
        t["entries"][k] = copy.deepcopy(measured["entries"][k])
    return t


def refit(table):
    """The entries layout_calibration_results.py fits to one run each, bisected again on `table` until the time
    model meets that run's measured tokens/s (the host entries, which it derives with step.fixed_s, are kept)."""
    from layout_calibration_results import FIT_SHAPES, FITS

    t = copy.deepcopy(table)
    cases = {c["id"]: c for c in load_checks()}
    for _ in range(3):  # the fitted entries act on each other's runs: a few rounds settle them
        for name, case_id, _what in FITS:
            lo, hi, _unit, shape = FIT_SHAPES.get(name, (0.0, 0.1, "s", lambda v: v))
            for _ in range(60):
                mid = (lo + hi) / 2
                t["entries"][name] = dict(t["entries"][name], value=shape(mid))
                err = predict(cases[case_id], {("calib", "h200"): Calibration(t)})["error"]
                lo, hi = (mid, hi) if err > 0 else (lo, mid)
            t["entries"][name] = dict(t["entries"][name], value=shape((lo + hi) / 2))
    return t


def errors(table, cases):
    cache = {("calib", "h200"): Calibration(table)}
    return {c["id"]: predict(c, cache)["error"] for c in cases}


def summary(err, ids):
    e = [abs(err[i]) for i in ids]
    return {"within_15pct": sum(x <= TARGET for x in e), "cases": len(e), "mean_abs_error": sum(e) / len(e)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measured", default=os.path.join(HERE, "layout_calibration_h200.json"))
    ap.add_argument("--entries", default=None, help="comma-separated measured entries for (b) (default: all changed)")
    ap.add_argument("--out", default="comparison.json", help="file name beside this script")
    ap.add_argument("--write-merged", default=None, help="also write table (b) here (never into pretrain/)")
    args = ap.parse_args(argv)
    with open(calibration_path("h200")) as f:
        base = json.load(f)
    with open(args.measured) as f:
        measured = json.load(f)
    # the entries this run measured name it as their source; the rest of the file is the table it started from
    # (an older h200.json by now, perhaps), so only these are merged
    changed = [k for k, v in measured["entries"].items()
               if os.path.basename(str((v.get("source") or {}).get("file"))) == os.path.basename(args.measured)]
    if args.entries:
        unknown = sorted(set(args.entries.split(",")) - set(changed))
        if unknown:
            raise SystemExit(f"--entries: {', '.join(unknown)} not among the changed entries ({', '.join(changed)})")
        changed = args.entries.split(",")
    cases = [c for c in load_checks() if c["gpu_kind"] == "h200"]
    roles = {c["id"]: c["role"] for c in cases}
    b = merged(base, measured, changed)
    if args.write_merged:
        with open(args.write_merged, "w") as f:
            json.dump(b, f, indent=1)
    tables = {"a_committed": base, "b_merged": b, "b_merged_refit": refit(b)}
    tables.update({"only " + k: merged(base, measured, [k]) for k in changed})
    err = {n: errors(t, cases) for n, t in tables.items()}
    checks = [i for i in roles if roles[i] == "check"]
    out = {"changed_entries": changed,
           "summary": {n: {"checks": summary(e, checks), "all_h200": summary(e, list(roles))} for n, e in err.items()},
           "cases": [{"id": i, "role": roles[i], **{n: err[n][i] for n in err}} for i in roles]}
    with open(os.path.join(HERE, args.out), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    for n, s in out["summary"].items():
        c = s["checks"]
        print(f"{n:45s} checks within 15%: {c['within_15pct']}/{c['cases']}, mean |error| "
              f"{100 * c['mean_abs_error']:.2f}%")
    print("\n| case | role | error (a) | error (b) | (b) refitted |\n|---|---|---:|---:|---:|")
    for r in out["cases"]:
        a, m, f = r["a_committed"], r["b_merged"], r["b_merged_refit"]
        print(f"| {r['id']} | {r['role']} | {100 * a:+.1f}% | {100 * m:+.1f}% | {100 * f:+.1f}% |")


if __name__ == "__main__":
    main()
