"""The manager's own series, and one exposition from several engines' (each engine keeps its own registry).

    metrale_model_loads_total{model_name, outcome="ok"|"error"}
    metrale_model_unloads_total{model_name, reason="idle"|"keep_alive"|"evicted"|"died"|"shutdown"}
    metrale_model_resident_bytes{model_name}      what the budget counts the model at while loaded, else 0
    metrale_requests_rejected_total{model_name="", reason}   requests refused before a model was resolved

merge_expositions() joins text expositions: one HELP and TYPE per family (the first seen), then every
family's samples from every part, so that promtool accepts the result; each engine's series keep their
`model_name` label, which relabel() sets to the model's id in this server.
"""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

LOAD_OUTCOMES = ("ok", "error")
UNLOAD_REASONS = ("idle", "keep_alive", "evicted", "died", "shutdown")
_MODEL_NAME_LABEL = re.compile(r'model_name="(?:[^"\\]|\\.)*"')


class ManagerMetrics:
    """Counts loads and unloads per model (its own registry, exposed with the engines' series)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._loads = Counter("metrale_model_loads", "Model loads by outcome.", ["model_name", "outcome"],
                              registry=self.registry)
        self._unloads = Counter("metrale_model_unloads", "Model unloads by reason.", ["model_name", "reason"],
                                registry=self.registry)
        self._resident = Gauge("metrale_model_resident_bytes", "Bytes a loaded model is counted at against the "
                               "memory budget (weights + KV pool); 0 when unloaded.", ["model_name"],
                               registry=self.registry)
        self._rejected = Counter("metrale_requests_rejected", "Requests refused at submit time, by reason.",
                                 ["model_name", "reason"], registry=self.registry)

    def register_models(self, model_ids: list[str]) -> None:
        """Create every model's series at 0, so that a rate() sees the first load."""
        for model_id in model_ids:
            for outcome in LOAD_OUTCOMES:
                self._loads.labels(model_id, outcome)
            for reason in UNLOAD_REASONS:
                self._unloads.labels(model_id, reason)
            self._resident.labels(model_id).set(0)

    def loaded(self, model_id: str, outcome: str, resident_bytes: int) -> None:
        self._loads.labels(model_id, outcome).inc()
        self._resident.labels(model_id).set(resident_bytes)

    def unloaded(self, model_id: str, reason: str) -> None:
        self._unloads.labels(model_id, reason).inc()
        self._resident.labels(model_id).set(0)

    def record_rejected(self, reason: str) -> None:
        """A request refused before it named a model this server has (no model label: a client chose it)."""
        self._rejected.labels("", reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def relabel(exposition: bytes, model_id: str) -> bytes:
    """Every `model_name` label of an engine's exposition set to `model_id` (its id in this server)."""
    escaped = model_id.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    replacement = f'model_name="{escaped}"'
    lines = [line if line.startswith("#") else _MODEL_NAME_LABEL.sub(lambda _: replacement, line)
             for line in exposition.decode().splitlines()]
    return ("\n".join(lines) + "\n").encode() if lines else b""


def merge_expositions(parts: list[bytes]) -> bytes:
    """One exposition of every part's families: HELP and TYPE once per family (the first part's), then the
    samples of every part in order."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for part in parts:
        family = ""
        for line in part.decode().splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split(" ", 3)[2]
                kind = line[:6]
                header = headers.setdefault(family, [])
                samples.setdefault(family, [])
                if not any(existing.startswith(kind) for existing in header):
                    header.append(line)
            elif line and not line.startswith("#"):
                samples.setdefault(family, []).append(line)
                headers.setdefault(family, [])
    out = [line for family in headers for line in (*headers[family], *samples[family])]
    return ("\n".join(out) + "\n").encode() if out else b""
