#!/usr/bin/env python3
"""Sums the statement durations that `outbox-bench --auto-explain` sends to the Postgres
server log, per database and statement: calls, total and mean executor time.

    python3 docs/bench/auto_explain_summary.py /var/log/postgresql/postgresql-15-main.log [DATABASE]

Statements run inside a function (outbox_claim's, for example) are listed on their own and
also counted in their caller's time. Only executor time is logged: planning is not in it,
so a function's own time minus its statements' is its planning and PL/pgSQL overhead.
"""

import collections
import re
import sys

DURATION = re.compile(r"\[\d+\] \S*@(\S+) LOG:  duration: ([0-9.]+) ms  plan:")


def main():
    path = sys.argv[1]
    only = sys.argv[2] if len(sys.argv) > 2 else None
    stats = collections.defaultdict(lambda: [0, 0.0])
    pending = None
    with open(path, errors="replace") as f:
        for line in f:
            m = DURATION.search(line)
            if m:
                pending = (m.group(1), float(m.group(2)))
                continue
            if pending and "Query Text:" in line:
                db, ms = pending
                pending = None
                if only and db != only:
                    continue
                text = " ".join(line.split("Query Text:", 1)[1].split())[:110]
                s = stats[(db, text)]
                s[0] += 1
                s[1] += ms
    for (db, text), (calls, total) in sorted(stats.items(), key=lambda kv: -kv[1][1]):
        print(f"{db}\t{calls}\t{total:.1f} ms\t{total / calls:.3f} ms\t{text}")


if __name__ == "__main__":
    main()
