"""The checkpoint store against a really full disk: HDF5's failed writes become one OSError naming the file.

The store refuses a save that cannot fit before writing (tested through the app in test_app_failures);
here that check is switched off so that HDF5 itself hits ENOSPC mid-file, as it does when another
process fills the disk during a save.
"""

import errno
import subprocess

import pytest
import torch

from mpicomm.checkpoint import latest_checkpoint, save_checkpoint, store

from .conftest import mount_tmpfs


class One:
    """A one-process stand-in for a communicator (the store needs only these three calls; no MPI here)."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def allgather(self, x):
        return [x]


def test_enospc_inside_hdf5_is_one_error_naming_the_file_and_no_traceback_flood(tmp_path, monkeypatch, capfd):
    disk = tmp_path / "disk"
    mount_tmpfs(disk, "1m")
    try:
        monkeypatch.setattr(store, "_check_space", lambda directory, need: None)
        with pytest.raises(OSError) as caught:
            save_checkpoint(disk, One(), {"w": torch.ones(1 << 20)}, step=1)  # 4 MiB into 1 MiB
        assert caught.value.errno == errno.ENOSPC, caught.value
        assert "rank-00000.h5" in str(caught.value) and "No space left on device" in str(caught.value)
        assert sorted(p.name for p in disk.iterdir()) == []  # the temporary directory is gone
        assert latest_checkpoint(disk) is None
        err = capfd.readouterr().err
        assert "Traceback" not in err and "Exception ignored" not in err, err[-2000:]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)
