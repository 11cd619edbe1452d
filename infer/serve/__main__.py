"""`python -m infer.serve`: see infer.serve.server."""

import sys

from infer.cli import run_cli
from infer.parallel import tp_main
from infer.serve.server import main

sys.exit(run_cli(tp_main(main)))
