"""Schemathesis, the property-based API fuzzer, against a running `metrale serve`, driven by its /openapi.json.

    result = fuzz("http://127.0.0.1:8000", max_time_s=40, report_dir=tmp_path, seed=7)
    result.requests, result.statuses, result.failures       # counts from Schemathesis' HAR and JSON reports
    settled(server)                                          # nothing running or waiting, every KV block free

Checks: every Schemathesis check but max_response_time (wall-clock speed), positive_data_acceptance (a
schema-valid body may still ask for something the server refuses: temperature 3, a prompt longer than the
context; those are 400s by design) and not_a_server_error, which is done here over every answer in the HAR: a 5xx is a failure unless its body
is a documented engine failure (KNOWN_SERVER_ERRORS). So a failure is an unknown 5xx, an undocumented
status or content type, a response body off its schema, an invalid body accepted, a 405 without Allow,
or auth ignored. Used by tests/server/test_api_fuzz.py (a short budget,
the tiny model) and benchmarks/api_fuzz.py (a long one, the real default model).
"""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from tests.server.serve import ServerProcess

CHECKS = ("status_code_conformance,content_type_conformance,response_headers_conformance,response_schema_conformance,"
          "negative_data_rejection,missing_required_header,unsupported_method,allow_header_conformance,"
          "use_after_free,ensure_resource_availability,ignored_auth")  # "all" would add max_response_time
# 500s the server documents: a request whose structured-output constraint no token can satisfy (with the
# tiny model's made-up vocabulary, any JSON constraint; with a real one, e.g. allowed_token_ids disjoint from
# a guided_choice) fails in the engine at its first token. Reported as a finding: it should be a 400.
KNOWN_SERVER_ERRORS = ("StructuredOutputError: structured output: token",)
# Findings in routes this suite does not own, reported to their owners: (Schemathesis code, path prefixes).
# Ollama's routes answer 405 without an Allow header (metrale/server/ollama.py raises a plain APIError).
KNOWN_FAILURES: tuple[tuple[str, re.Pattern[str]], ...] = ()  # (code, the paths it is known on: re.match)
MEMORY_LIMIT_BYTES = 6 << 30  # the fuzzed server's address space: a runaway allocation fails it, not the machine


@dataclass
class FuzzResult:
    """One Schemathesis run: what it sent, what came back, what it flagged."""

    exit_code: int
    requests: int = 0
    generated: int = 0
    statuses: dict[str, dict[int, int]] = field(default_factory=dict)  # "POST /v1/completions" -> {400: 31, ...}
    failures: list[dict] = field(default_factory=list)  # Schemathesis' failure groups (code, title, operations)
    errors: list = field(default_factory=list)  # Schemathesis' own errors (e.g. a connection refused)
    output: str = ""

    known_server_errors: int = 0  # 5xx answers with a documented body (KNOWN_SERVER_ERRORS)
    unknown_server_errors: list[dict] = field(default_factory=list)  # the others: request and response
    no_answer: int = 0  # requests the server never answered (status 0 in the HAR: it hung or died)

    @property
    def unknown_failures(self) -> list[dict]:
        """Schemathesis' failure groups but the known ones (KNOWN_FAILURES)."""
        return [f for f in self.failures if not any(
            f["code"] == code and all(paths.match(op.split(" ", 1)[1]) for op in f["operations"])
            for code, paths in KNOWN_FAILURES)]

    @property
    def clean(self) -> bool:
        """No unknown failed check, no fuzzer error, no unknown 5xx, every request answered."""
        return not (self.unknown_failures or self.errors or self.unknown_server_errors or self.no_answer)

    def summary(self) -> dict:
        totals = collections.Counter()
        for counts in self.statuses.values():
            totals.update(counts)
        return {"requests": self.requests, "generated_cases": self.generated, "exit_code": self.exit_code,
                "statuses": dict(sorted(totals.items())), "known_server_errors": self.known_server_errors,
                "unknown_server_errors": self.unknown_server_errors[:10], "no_answer": self.no_answer,
                "per_operation": {op: dict(sorted(c.items())) for op, c in sorted(self.statuses.items())},
                "failures": [{k: f.get(k) for k in ("code", "title", "count", "operations")} for f in self.failures],
                "unknown_failures": len(self.unknown_failures),
                "errors": self.errors}


def fuzz(base_url: str, *, report_dir: Path, max_time_s: int | None = None, max_examples: int | None = None,
         phases: str | None = None, seed: int | None = None, workers: int = 1, api_key: str | None = None,
         extra_args: tuple[str, ...] = ()) -> FuzzResult:
    """Run `schemathesis run <base_url>/openapi.json`: `max_examples` cases per operation and phase, or for
    about `max_time_s` seconds (fuzzing repeats until then); `phases` e.g. "coverage,fuzzing" (default: all);
    `extra_args`: more `schemathesis run` options (e.g. "--include-method", "GET"). Reports in `report_dir`.
    One worker by default: with several threads, hypothesis' lambda descriptions hit CPython 3.11's
    "AST constructor recursion depth mismatch" (a fuzzer error, not the server's)."""
    report_dir.mkdir(parents=True, exist_ok=True)
    har, report = report_dir / "requests.har.json", report_dir / "report.json"
    command = [sys.executable, "-m", "schemathesis.cli", "run", f"{base_url}/openapi.json", "--checks", CHECKS,
               "--workers", str(workers),
               "--request-timeout", "120", "--suppress-health-check", "all", "--generation-database", "none",
               "--report", "har,json", "--report-har-path", str(har), "--report-json-path", str(report),
               "--no-color", "--output-truncate", "true"]
    if max_time_s is not None:
        command += ["--max-time", str(max_time_s)]
    if phases is not None:
        command += ["--phases", phases]
    if seed is not None:
        command += ["--seed", str(seed)]
    if max_examples is not None:
        command += ["--max-examples", str(max_examples)]
    if api_key is not None:
        command += ["--header", f"Authorization: Bearer {api_key}"]
    command += extra_args
    done = subprocess.run(command, cwd=report_dir, capture_output=True, text=True, timeout=(max_time_s or 0) + 900)
    result = FuzzResult(done.returncode, output=done.stdout + done.stderr)
    if report.exists():
        summary = json.loads(report.read_text())
        result.generated = summary["test_cases"]["generated"]
        result.failures, result.errors = summary["failures"], summary["errors"]
    if har.exists():
        _count(result, json.loads(har.read_text())["log"]["entries"])
    return result


def _count(result: FuzzResult, entries: list[dict]) -> None:
    """Statuses per operation, and the 5xx and unanswered requests, from the HAR's entries."""
    result.requests = len(entries)
    statuses: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for entry in entries:
        name, status = operation(entry["request"]["method"], entry["request"]["url"]), entry["response"]["status"]
        statuses[name][status] += 1
        body = entry["response"]["content"].get("text", "")
        if status == 0:
            result.no_answer += 1
        elif status >= 500 and any(known in body for known in KNOWN_SERVER_ERRORS):
            result.known_server_errors += 1
        elif status >= 500:
            request = entry["request"].get("postData", {}).get("text", "")
            result.unknown_server_errors.append({"operation": name, "status": status, "response": body[:400],
                                                 "request": request[:2000]})
    result.statuses = {op: dict(counts) for op, counts in statuses.items()}


def operation(method: str, url: str) -> str:
    """"GET /v1/models/{model}" for any model id, else the method and the path."""
    path = urlsplit(url).path
    return f"{method} {'/v1/models/{model}' if path.startswith('/v1/models/') else path}"


def settled(server: ServerProcess, timeout_s: float = 120.0) -> dict[str, float]:
    """Wait until nothing runs or waits, then the gauges that say every KV block is free."""
    deadline = time.monotonic() + timeout_s
    while True:
        gauges = {name: server.metric(name) for name in
                  ("metrale_requests_running", "metrale_requests_waiting", "metrale_kv_cache_usage_ratio")}
        if not any(gauges.values()) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.5)
