"""The long run of the schema-driven API fuzzer (the short one is tests/server/test_api_fuzz.py).

    .venv/bin/python benchmarks/api_fuzz.py --max-time 600 [--model PATH] [--api-key K] [--seed N] [--json out.json]
    (PYTHONPATH=. python benchmarks/api_fuzz.py ... from a checkout without the editable install)

Starts `metrale serve` (the real default model unless --model), points Schemathesis at its /openapi.json
for --max-time seconds (see tests/server/api_fuzz.py for the checks), then
prints the counts: requests, statuses per operation, Schemathesis' failures, the 5xx (documented and
not) and unanswered requests, whether the server is still up and every KV block free. The server runs
under a 6 GiB address-space limit, so a runaway request fails it rather than the machine. Exit status 1
when anything is wrong. Reports (HAR, JSON) go to --report-dir.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.server.api_fuzz import MEMORY_LIMIT_BYTES, fuzz, settled  # noqa: E402
from tests.server.serve import ServerProcess  # noqa: E402


def main(args: argparse.Namespace) -> int:
    serve_args = ["--max-model-len", str(args.max_model_len), "--kv-cache-mib", str(args.kv_cache_mib)]
    if args.model:
        serve_args += ["--model", args.model]
    if args.api_key:
        serve_args += ["--api-key", args.api_key]
    report_dir = Path(args.report_dir or tempfile.mkdtemp(prefix="metrale-api-fuzz-"))
    with ServerProcess(*serve_args, memory_limit_bytes=MEMORY_LIMIT_BYTES) as server:
        result = fuzz(server.url(), max_time_s=args.max_time, report_dir=report_dir, seed=args.seed,
                      workers=args.workers, api_key=args.api_key, phases=args.phases)
        summary = result.summary()
        summary["after"] = settled(server)
        summary["alive"] = server.proc.poll() is None and server.get("/health")[0] == 200
    summary["report_dir"] = str(report_dir)
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0 if result.clean and summary["alive"] and not any(summary["after"].values()) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-time", type=int, default=600, help="seconds of fuzzing")
    parser.add_argument("--model", default=None, help="default: the real default model (SmolLM2-135M)")
    parser.add_argument("--api-key", default=None, help="serve with this key and send it (also checks ignored_auth)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--workers", type=int, default=1,
                        help="concurrent fuzzer threads (more hit a CPython 3.11 ast race inside hypothesis)")
    parser.add_argument("--phases", default="examples,coverage,fuzzing",
                        help="schemathesis phases; fuzzing repeats until --max-time (stateful adds little here: "
                             "the document has no links)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-mib", type=int, default=256)
    parser.add_argument("--report-dir", default=None, help="where the HAR and JSON reports go (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write the summary here")
    sys.exit(main(parser.parse_args()))
