"""Longer fuzzing run of the OpenAI server (the bounded one is tests/test_fuzz_api.py), with statistics.

Serves a tiny llama checkpoint (vocab 512, float32) in-process and sends ``--examples`` hypothesis-generated bad or
borderline requests (tokenfab/testing/api_fuzz.py) on one keep-alive connection, plus ``--schemathesis`` negative
cases per POST operation of the app's own OpenAPI schema, while a greedy 48-token stream re-runs on another
connection and is compared with its result alone. Every answer is checked (no 5xx, no dropped connection, a 4xx in
OpenAI's error JSON where one is due). Failures do not stop the run: all are counted and the first ones kept.

    .venv/bin/python benchmarks/fuzz_api.py --examples 3000 --schemathesis 200

Writes ``benchmarks/results/<date>-fuzz.{md,json}`` (``--out`` changes the stem): requests by kind, status codes,
failures, innocent-stream runs. Exit status 0 when nothing failed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import Counter, defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--examples", type=int, default=3000, help="hypothesis-generated requests")
    ap.add_argument("--schemathesis", type=int, default=200, help="schemathesis negative cases per POST operation")
    ap.add_argument("--seed", type=int, default=12345)
    ap.add_argument("--workdir", default="/tmp/tokenfab-fuzz")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import httpx
    from hypothesis import HealthCheck, given, seed, settings

    from server_fixtures import start_test_server
    from test_fuzz_api import INNOCENT, Innocents, innocent_stream, send
    from tokenfab.testing.api_fuzz import FuzzCase, check_answer, fuzz_cases
    from tokenfab.testing.tiny_checkpoints import make_tiny_checkpoint

    model = make_tiny_checkpoint(os.path.join(args.workdir, "llama"), "llama", vocab_size=512)
    handle = start_test_server(model)
    base = handle.base_url
    cfg = dict(deadline=None, database=None, print_blob=False, phases=[__import__("hypothesis").Phase.generate],
               suppress_health_check=list(HealthCheck))
    by_kind: dict = defaultdict(Counter)
    failures: list[dict] = []
    t0 = time.monotonic()
    with httpx.Client(base_url=base, trust_env=False, timeout=60) as alone:
        reference = innocent_stream(alone)
    client = httpx.Client(base_url=base, trust_env=False, timeout=600)
    dropped = 0

    @seed(args.seed)
    @settings(max_examples=args.examples, **cfg)
    @given(fuzz_cases(512))
    def run(case):
        nonlocal dropped, client
        try:
            r = send(client, case)
        except httpx.TransportError as e:
            dropped += 1
            by_kind[case.kind]["dropped"] += 1
            failures.append({"kind": case.kind, "case": repr(case), "why": f"connection dropped: {e!r}"})
            client.close()
            client = httpx.Client(base_url=base, trust_env=False, timeout=600)
            return
        by_kind[case.kind][str(r.status_code)] += 1
        why = check_answer(case, r.status_code, r.content)
        if why is not None:
            failures.append({"kind": case.kind, "case": repr(case), "why": why})

    with Innocents(base) as inn:
        run()
        t_fuzz = time.monotonic() - t0
        st_stats: dict = defaultdict(Counter)
        if args.schemathesis:
            import schemathesis
            from schemathesis import GenerationMode
            spec = httpx.get(base + "/openapi.json", trust_env=False).json()
            for result in schemathesis.openapi.from_dict(spec).get_all_operations():
                op = result.ok()
                if op.method.upper() != "POST":
                    continue

                @seed(args.seed)
                @settings(max_examples=args.schemathesis, **cfg)
                @given(op.as_strategy(generation_mode=GenerationMode.NEGATIVE))
                def run_st(case):
                    try:
                        r = case.call(base_url=base, timeout=600)  # a valid body may generate to the context
                    except Exception as e:  # noqa: BLE001 - requests' transport errors
                        st_stats[op.label]["dropped"] += 1
                        failures.append({"kind": "schemathesis", "case": f"{op.label} {case.body!r}"[:500],
                                         "why": f"connection dropped: {e!r}"})
                        return
                    st_stats[op.label][str(r.status_code)] += 1
                    why = check_answer(FuzzCase("schemathesis", op.method, op.path, b"", expect="not5xx"),
                                       r.status_code, r.content)
                    if why is not None:
                        failures.append({"kind": "schemathesis", "case": f"{op.label} {case.body!r}"[:500],
                                         "why": why})

                run_st()
    client.close()
    wall = time.monotonic() - t0
    healthy = handle.async_llm.health_error() is None
    handle.stop()
    innocent_ok = sum(res == reference for res in inn.results)
    statuses = Counter()
    for c in by_kind.values():
        statuses.update(c)
    for c in st_stats.values():
        statuses.update(c)
    rep = {"examples": args.examples, "schemathesis_per_operation": args.schemathesis, "seed": args.seed,
           "requests": sum(statuses.values()), "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
           "schemathesis": {k: dict(v) for k, v in sorted(st_stats.items())}, "status_codes": dict(statuses),
           "failures": len(failures), "failure_examples": failures[:20], "dropped_connections": dropped,
           "innocent_runs": len(inn.results), "innocent_identical": innocent_ok, "innocent_errors": inn.errors[:5],
           "innocent_reference_tokens": reference[1], "server_healthy_after": healthy,
           "fuzz_wall_s": round(t_fuzz, 1), "wall_s": round(wall, 1)}
    rep["passed"] = (not failures and not dropped and not inn.errors and innocent_ok == len(inn.results) > 0
                     and healthy)
    stem = args.out or os.path.join(HERE, "results", time.strftime("%Y-%m-%d") + "-fuzz")
    env = " ".join(f"{k}={os.environ[k]}" for k in ("TOKENFAB_CPU_KERNELS",) if k in os.environ)
    command = (env + " " if env else "") + "python benchmarks/fuzz_api.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    with open(stem + ".json", "w") as f:
        json.dump(dict(rep, command=command), f, indent=1)
    fxx = sum(v for k, v in statuses.items() if k.startswith("5"))
    lines = [f"# API fuzzing: {rep['requests']} requests", "", f"Command: `{command}`", "",
             "Server: tiny llama (vocab 512, float32) in-process, max_model_len 256; strategies in "
             "tokenfab/testing/api_fuzz.py (hypothesis, seed above) and schemathesis negative mode on the app's "
             "OpenAPI schema. Every answer checked: no 5xx, no dropped connection, a 4xx with OpenAI's error JSON "
             "(code = status) where one is due; kinds marked borderline in api_fuzz.py may also succeed.", "",
             f"**{'PASS' if rep['passed'] else 'FAIL'}**: {rep['failures']} failed checks, {fxx} 5xx, "
             f"{dropped} dropped connections; the innocent greedy stream ({reference[1]} tokens) ran "
             f"{len(inn.results)} times alongside, {innocent_ok} identical to its run alone; server healthy after: "
             f"{healthy}. Wall time {rep['wall_s']} s (CPU shared with other jobs).", "",
             "## Requests by kind and status", "", "| kind | requests | status codes |", "|---|---|---|"]
    for k, v in rep["by_kind"].items():
        lines.append(f"| {k} | {sum(v.values())} | {', '.join(f'{s}: {n}' for s, n in sorted(v.items()))} |")
    for k, v in rep["schemathesis"].items():
        lines.append(f"| schemathesis {k} | {sum(v.values())} | "
                     f"{', '.join(f'{s}: {n}' for s, n in sorted(v.items()))} |")
    lines += ["", "All status codes: " + ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items())), ""]
    if failures:
        lines += ["## Failures (first 20)", ""] + [f"- {f['kind']}: {f['why'][:300]} ({f['case'][:300]})"
                                                   for f in failures[:20]] + [""]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return 0 if rep["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
