"""Merge the per-section JSON files of ``benchmarks/gpu_check.py --json`` (as written by
``benchmarks/device/run.sh``) into one summary, print it, and set the exit status.

Usage::

    python benchmarks/device/summarize.py DIR OUT.json

``DIR`` holds ``correctness.<k>.json`` (one per ``--shard k/N``; ``N`` from the file
``DIR/shards``), ``engine.json``, ``decode.json`` and ``prefill.json``; a missing file means
that process was killed (its time limit) or crashed before it wrote anything, and
``DIR/<section>.status`` (written by run.sh) holds that process's exit status.

Exit status: 0 when correctness and engine passed and decode/prefill did not fail (a timing
section skipped for time is not a failure); 1 otherwise.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SECTIONS = ("correctness", "engine", "decode", "prefill")
REQUIRED = ("correctness", "engine")  # must pass; the timing sections must not fail


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _status_note(d: Path, name: str) -> str:
    try:
        rc = int((d / f"{name}.status").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return "did not run"
    if rc in (124, 137):
        return f"killed at its time limit (exit {rc})"
    return f"exited {rc} without writing its JSON"


def merge(d: Path) -> dict:
    """Return ``{"gpu", "versions", "sections": {name: {...}}, "ok"}`` from the files in ``d``."""
    out: dict = dict(gpu=None, versions=None, sections={})
    try:
        shards = int((d / "shards").read_text())
    except (OSError, ValueError):
        shards = 0
    parts = []
    for k in range(shards):
        rep = _read(d / f"correctness.{k}.json")
        rec = (rep or {}).get("sections", {}).get("correctness")
        if rep:
            out["gpu"] = out["gpu"] or rep.get("gpu")
            out["versions"] = out["versions"] or rep.get("versions")
        parts.append(rec if rec else dict(status="fail", error=f"shard {k}/{shards}: "
                                          + (rep or {}).get("error", _status_note(d, f"correctness.{k}"))))
    if parts:
        failures = [f for p in parts for f in p.get("failures", [])]
        failures += [p["error"] for p in parts if p.get("error")]
        statuses = [p.get("status") for p in parts]
        out["sections"]["correctness"] = dict(
            status="fail" if "fail" in statuses or None in statuses else
            ("skipped" if "skipped" in statuses else "pass"),
            shards=shards, checks=sum(p.get("checks", 0) for p in parts),
            passed=sum(p.get("passed", 0) for p in parts), failures=failures,
            cut_short=any(p.get("cut_short") for p in parts),
            seconds=max((p.get("seconds") or 0) for p in parts))
    for name in SECTIONS[1:]:
        path = d / f"{name}.json"
        if not path.exists() and not (d / f"{name}.status").exists():
            continue  # not asked for
        rep = _read(path)
        if rep:
            out["gpu"] = out["gpu"] or rep.get("gpu")
            out["versions"] = out["versions"] or rep.get("versions")
        rec = (rep or {}).get("sections", {}).get(name)
        out["sections"][name] = rec or dict(status="fail", error=(rep or {}).get("error", _status_note(d, name)))
    secs = out["sections"]
    out["ok"] = (all(secs.get(s, {}).get("status") == "pass" for s in REQUIRED)
                 and all(secs.get(s, {}).get("status") != "fail" for s in SECTIONS))
    return out


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    d, dst = Path(args[0]), Path(args[1])
    out = merge(d)
    dst.write_text(json.dumps(out, indent=1))
    gpu = (out["gpu"] or {}).get("name", "no GPU reported")
    print(f"\n== summary ({gpu}; {json.dumps(out['versions'])})")
    for name in SECTIONS:
        rec = out["sections"].get(name)
        if rec is None:
            print(f"  {name:12s} not run")
            continue
        extra = ""
        if name == "correctness" and "checks" in rec:
            extra = f"{rec['passed']}/{rec['checks']} checks in {rec['shards']} shards"
            extra += ", cut short by the time budget" if rec.get("cut_short") else ""
        elif name == "engine" and rec.get("prompts"):
            same = sum(p["same"] for p in rec["prompts"])
            worst = max((p.get("max_logprob_diff") or 0) for p in rec["prompts"])
            extra = f"{same}/{len(rec['prompts'])} prompts same tokens, max logprob diff {worst:.1e}"
        elif rec.get("rows"):
            done = [r for r in rec["rows"] if "error" not in r and "skipped" not in r]
            extra = f"{len(done)}/{len(rec['rows'])} cases timed"
        err = f" [{rec['error']}]" if rec.get("error") else ""
        print(f"  {name:12s} {rec.get('status', '?').upper():7s} {extra}{err}")
        for f in rec.get("failures", [])[:20]:
            print(f"      {f}")
    print(f"  => {'OK' if out['ok'] else 'FAILED'} (written to {dst})")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
