import sys

from infer.bench.cli import main
from infer.cli import run_cli
from infer.parallel import tp_main

sys.exit(run_cli(tp_main(main)))
