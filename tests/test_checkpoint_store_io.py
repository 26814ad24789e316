"""The checkpoint store against a really full disk: HDF5's failed writes become one OSError naming the file.

The store refuses a save that cannot fit before writing (tested through the app in test_app_failures);
here that check is switched off so that HDF5 itself hits ENOSPC mid-file, as it does when another
process fills the disk during a save. It runs in a child process: HDF5 cannot close a file it failed
to write, and may crash at interpreter exit (documented in docs/checkpoints.md).
"""

import os
import subprocess
import sys

from .conftest import mount_tmpfs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = """
import sys, torch
from mpicomm.checkpoint import latest_checkpoint, save_checkpoint, store

class One:  # a one-process stand-in for a communicator (the store needs only these three calls)
    def Get_rank(self): return 0
    def Get_size(self): return 1
    def allgather(self, x): return [x]

store._check_space = lambda directory, need: None
try:
    save_checkpoint(sys.argv[1], One(), {"w": torch.ones(1 << 20)}, step=1)  # 4 MiB into 1 MiB
except OSError as exc:
    print(f"errno={exc.errno} latest={latest_checkpoint(sys.argv[1])} message={exc}", flush=True)
"""


def test_enospc_inside_hdf5_is_one_error_naming_the_file_and_no_traceback_flood(tmp_path):
    disk = tmp_path / "disk"
    mount_tmpfs(disk, "1m")
    try:
        child = subprocess.run([sys.executable, "-c", CHILD, str(disk)], capture_output=True, text=True,
                               cwd=REPO, timeout=120)
        assert "errno=28 latest=None message=" in child.stdout, (child.stdout, child.stderr[-2000:])
        assert "rank-00000.h5" in child.stdout and "No space left on device" in child.stdout
        assert "Traceback" not in child.stderr and "Exception ignored" not in child.stderr, child.stderr[-2000:]
        assert sorted(p.name for p in disk.iterdir()) == []  # the temporary directory is gone
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)
