"""`python -m tests.kill_after_shards N [overrides]`: data_tools.precompute, SIGKILLed while writing shard N + 1
(N shards finished), its temp file left torn (half of it written), as a crash would leave it."""

from __future__ import annotations

import os
import signal
import sys

from data_tools import precompute
from infer.cli import run_cli


def main() -> None:
    finished_before_kill = int(sys.argv.pop(1))
    write_shard = precompute.FeatureExtractor.write_shard
    written = 0

    def write_shard_or_die(self, f, records, meta, bar=None) -> None:
        nonlocal written
        write_shard(self, f, records, meta, bar)
        if written == finished_before_kill:  # this shard's temp file, torn before it is renamed into place
            f.flush()
            f.truncate(os.fstat(f.fileno()).st_size // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        written += 1

    precompute.FeatureExtractor.write_shard = write_shard_or_die
    sys.exit(run_cli(precompute.main))


if __name__ == "__main__":
    main()
