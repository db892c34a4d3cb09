"""The `metrale` command: demo, serve, fleet, bench, tokenizer export."""

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
    tokenizer = sub.add_parser("tokenizer", help="the model's tokenizer for other tools")
    tokenizer_sub = tokenizer.add_subparsers(dest="tokenizer_command", required=True)
    export = tokenizer_sub.add_parser("export", help="write a Hugging Face tokenizer folder (tokenizer.json, "
                                      "tokenizer_config.json) that AutoTokenizer loads")
    export.add_argument("folder")
    export.add_argument("--model", default=None, help="GGUF file or model folder (default: SmolLM2-135M-Instruct)")
    export.set_defaults(func=_export_tokenizer)
    return parser


def _export_tokenizer(args: argparse.Namespace) -> int:
    from metrale.loading.tokenizer_only import load_tokenizer
    from metrale.text.tokenizer_export import export_tokenizer

    folder = export_tokenizer(load_tokenizer(args.model), args.folder)
    print(f"wrote {folder}/tokenizer.json and tokenizer_config.json")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        from metrale.demo import main as demo_main
        return demo_main(args)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
