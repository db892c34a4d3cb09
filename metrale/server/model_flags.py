"""`metrale serve`'s many-models flags: --models DIR, a repeated --model NAME=PATH, --max-resident-bytes,
--idle-unload-after; and the ManagedModels they describe. A single `--model PATH` keeps the one-engine server."""

from __future__ import annotations

import argparse
import logging
import math
from typing import Callable

from metrale.config import EngineConfig
from metrale.manager.budget import default_max_resident_bytes, parse_bytes
from metrale.manager.catalog import catalog
from metrale.manager.manager import EngineFactory, ManagerConfig, ModelManager
from metrale.manager.metrics import ManagerMetrics
from metrale.server.managed import ManagedModels

logger = logging.getLogger(__name__)


def add_many_models_arguments(parser: argparse.ArgumentParser) -> None:
    many = parser.add_argument_group("many models (--models DIR or --model NAME=PATH ...)")
    many.add_argument("--models", default=None, metavar="DIR",
                      help="serve every .gguf file and model folder in DIR and one level below, by file stem / "
                           "folder name; each is loaded on its first request and unloaded when idle")
    many.add_argument("--max-resident-bytes", default=None, metavar="BYTES",
                      help="memory budget of the loaded models (weights as on disk + each KV pool), e.g. 8G; "
                           "loading past it unloads the least recently used idle model first "
                           "(default: 75%% of MemTotal minus 1 GiB)")
    many.add_argument("--idle-unload-after", type=float, default=300.0, metavar="SECONDS",
                      help="unload a model idle for this long, unless its last request set keep_alive "
                           "(default: 300, Ollama's 5 minutes; negative: never)")


class ModelSpecs(argparse.Action):
    """--model may repeat (NAME=PATH each): `model` keeps the last value, as a plain option would, and
    `model_specs` every value in order."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, "model_specs", [*model_specs(namespace), values])


def model_specs(args: argparse.Namespace) -> list[str]:
    """Every --model value, in order."""
    return list(getattr(args, "model_specs", None) or [])


def serves_many(args: argparse.Namespace) -> bool:
    """--models DIR, or --model given as NAME=PATH or more than once: models are loaded on demand."""
    specs = model_specs(args)
    return args.models is not None or len(specs) > 1 or any("=" in spec for spec in specs)


def models_from_flags(args: argparse.Namespace, engine_cfg: EngineConfig, make_engine: EngineFactory,
                      server_exposition: Callable[[], bytes]) -> ManagedModels:
    """The models of --models / --model NAME=PATH behind a ModelManager (engine_cfg: what each engine starts from);
    ValueError for bad flags."""
    if args.served_model_name is not None or args.model_alias:
        raise ValueError("--served-model-name and --model-alias name the one model of --model PATH; with several "
                         "models name each with --model NAME=PATH")
    if getattr(args, "lora_modules", None) or getattr(args, "enable_runtime_lora_updating", False):
        raise ValueError("LoRA adapters (--lora-modules, --enable-runtime-lora-updating) run on the one model of "
                         "--model PATH, not on models loaded on demand")
    entries = catalog(args.models, model_specs(args))
    budget = parse_bytes(args.max_resident_bytes) if args.max_resident_bytes else default_max_resident_bytes()
    idle_s = math.inf if args.idle_unload_after < 0 else args.idle_unload_after
    config = ManagerConfig(max_resident_bytes=budget, kv_cache_bytes=engine_cfg.kv_cache_bytes,
                           idle_unload_after_s=idle_s, max_waiting_per_model=engine_cfg.max_waiting)
    logger.info("serving %d models under a budget of %.1f GiB: %s", len(entries), budget / (1 << 30),
                ", ".join(entry.model_id for entry in entries))
    return ManagedModels(ModelManager(entries, make_engine, config, metrics=ManagerMetrics()), server_exposition)
