"""`python -m metrale.server ...` is `metrale serve ...`."""

import sys

from metrale.server.cli import serve_main

sys.exit(serve_main())
