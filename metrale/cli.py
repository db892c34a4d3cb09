"""The `metrale` command: demo, serve, fleet, bench."""

from __future__ import annotations

import argparse
import logging
import sys

from metrale.bench.cli import add_bench_parser
from metrale.server.cli import add_serve_parser
from metrale.server.fleet import add_fleet_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="metrale", description="Continuous-batching LLM serving on MLX")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the default model under concurrent load and print a summary")
    demo.add_argument("--requests", type=int, default=32)
    demo.add_argument("--max-tokens", type=int, default=128)
    demo.add_argument("--model", default=None, help="GGUF file or model folder (default: SmolLM2-135M-Instruct)")
    add_serve_parser(sub)
    add_fleet_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        from metrale.demo import main as demo_main
        return demo_main(args)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
