"""`python -m metrale.router_main ROUTER_ARGS...`: sglang-router's launcher, with its --api-key taken from
$METRALE_API_KEY so that the key never appears on a command line (`ps`, a pod spec's args).

The router sends that key to the replicas it probes (/health, /server_info, /get_load) and forwards
requests to: the key the replicas check. `metrale fleet`, deploy/k8s/router.yaml and
deploy/docker-compose.fleet.yml all start the router this way. Importing this module loads neither MLX
nor the engine (metrale's package __init__ is lazy).
"""

from __future__ import annotations

import os
import sys

API_KEY_VARIABLE = "METRALE_API_KEY"


def main(argv: list[str] | None = None) -> None:
    from sglang_router.launch_router import launch_router, parse_router_args

    args = parse_router_args(sys.argv[1:] if argv is None else argv)
    args.api_key = os.environ.get(API_KEY_VARIABLE) or None
    launch_router(args)


if __name__ == "__main__":
    main()
