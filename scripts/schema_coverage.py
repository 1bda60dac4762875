#!/usr/bin/env python3
"""How many of JSONSchemaBench's schemas tandem's grammar path compiles (docs/structured.md):
every schema file of each split directory through the same compile a request's
`response_format` takes (engine/constrain/grammar.py: llguidance, tandem's JSON options), counted
as compiled or refused, the refusals grouped by llguidance's message.

  git --git-dir=PATH/TO/jsonschemabench.git archive HEAD data/Github_easy data/Github_medium \\
      | tar -x -C /tmp/jsb
  .venv/bin/python scripts/schema_coverage.py /tmp/jsb/data/Github_easy /tmp/jsb/data/Github_medium

JSONSchemaBench: github:guidance-ai/jsonschemabench (data/<split>/*.json, one schema a file).
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time
from pathlib import Path


def reason(message: str) -> str:
    """A refusal's kind: llguidance's message without the parts that name this schema."""
    text = message.split(": ", 1)[-1] if message.startswith("the JSON schema") else message
    text = re.sub(r"\"[^\"]*\"|'[^']*'|`[^`]*`", "…", text)  # names and values
    text = re.sub(r"\d+", "N", text)
    return text[:90]


def cover(directory: Path) -> dict:
    from tandem.engine.constrain.grammar import Constraint, GrammarError
    files = sorted(directory.glob("*.json"))
    refused: collections.Counter[str] = collections.Counter()
    examples: dict[str, str] = {}
    compiled = 0
    started = time.perf_counter()
    for path in files:
        text = path.read_text(encoding="utf-8")
        try:
            Constraint("json_schema", text, path.name).compiled()
            compiled += 1
        except GrammarError as exc:
            kind = reason(str(exc))
            refused[kind] += 1
            examples.setdefault(kind, path.name)
    return {"split": directory.name, "total": len(files), "compiled": compiled,
            "share": round(compiled / len(files), 4) if files else None,
            "seconds": round(time.perf_counter() - started, 1),
            "refused": [{"reason": k, "schemas": n, "example": examples[k]}
                        for k, n in refused.most_common()]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("splits", type=Path, nargs="+", help="directories of schema files")
    ap.add_argument("--top", type=int, default=8, help="refusal kinds listed per split")
    ap.add_argument("--out", type=Path, help="write every count as JSON")
    args = ap.parse_args(argv)
    results = []
    for d in args.splits:
        if not d.is_dir():
            print(f"Error: {d} is not a directory", file=sys.stderr)
            print("Hint: extract JSONSchemaBench's data/ (see --help)", file=sys.stderr)
            return 2
        r = cover(d)
        results.append(r)
        print(f"{r['split']}: {r['compiled']}/{r['total']} compiled ({r['share']:.1%}), "
              f"{r['seconds']} s")
        for k in r["refused"][:args.top]:
            print(f"  {k['schemas']:4d}  {k['reason']}  (e.g. {k['example']})")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
