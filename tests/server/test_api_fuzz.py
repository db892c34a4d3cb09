"""The schema-driven fuzzer in the suite: Schemathesis reads /openapi.json and sends generated requests to a
real `metrale serve` on the tiny model: its coverage phase (every field's boundary and invalid values, wrong
types, undeclared methods, missing auth) and a fixed number of property-based cases per operation. No unknown
5xx, every request answered, no failed check, the process alive, every KV block free afterwards. Bounded by
counts, not time (~35 s of fuzzing in all on a loaded 2-core machine). The long run is benchmarks/api_fuzz.py."""

from __future__ import annotations

import pytest

from tests.server.api_fuzz import MEMORY_LIMIT_BYTES, fuzz, settled
from tests.server.serve import SMALL, ServerProcess

pytest.importorskip("schemathesis")
pytestmark = pytest.mark.timeout(300)
RUNS = {  # (api key, cases per operation after the coverage phase, phases, more schemathesis options, serve flags)
    "open": (None, 5, "coverage,fuzzing", (), ()),                        # ~2,500 requests, 23 operations
    "with-key": ("k3y", 3, "coverage", ("--include-method", "GET"), ()),  # ~110: 401s documented, auth never ignored
    "embed": (None, 10, "coverage,fuzzing", ("--include-path-regex", "embed"), ("--task", "embed")),  # the 3 routes
}


@pytest.mark.parametrize("run", RUNS)
def test_the_fuzzer_finds_nothing(tiny_model, tmp_path, run):
    api_key, examples, phases, extra, flags = RUNS[run]
    args = ("--model", tiny_model, *SMALL, *(("--api-key", api_key) if api_key else ()), *flags)
    with ServerProcess(*args, memory_limit_bytes=MEMORY_LIMIT_BYTES) as server:
        result = fuzz(server.url(), report_dir=tmp_path, max_examples=examples, phases=phases, seed=21,
                      api_key=api_key, extra_args=extra)
        summary = result.summary()
        assert result.requests > 100 and not result.errors, (summary, result.output[-4000:])
        assert result.unknown_server_errors == [] and result.no_answer == 0, summary
        assert result.unknown_failures == [], (summary, result.output[-8000:])
        assert result.clean and any(200 in counts for counts in result.statuses.values())  # it got through
        assert settled(server) == {"metrale_requests_running": 0, "metrale_requests_waiting": 0,
                                   "metrale_kv_cache_usage_ratio": 0}, summary
        assert server.proc.poll() is None and server.get("/health")[0] == 200
