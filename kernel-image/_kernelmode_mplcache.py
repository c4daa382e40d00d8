"""Seeds matplotlib's font cache in a fresh MPLCONFIGDIR, so that the first plot is fast.

Kernel containers run with a read-only root filesystem, and matplotlib only uses a *writable*
config/cache directory (MPLCONFIGDIR=/tmp/.matplotlib, on the container's tmpfs): without
help every new container would rebuild the font list on its first ``import matplotlib``.
The image build makes that list once, in SEED; ``_kernelmode_mplcache.pth`` imports this
module when Python starts, and when MPLCONFIGDIR does not exist yet it is created with a copy
of the seed. It never fails: anything unexpected leaves matplotlib to do as it always does.
"""

import os

SEED = "/opt/kernel-venv/share/kernelmode/matplotlib"


def _seed() -> None:
    dst = os.environ.get("MPLCONFIGDIR")
    if not dst or os.path.exists(dst) or not os.path.isdir(SEED):
        return
    try:
        os.makedirs(dst, mode=0o700)
    except OSError:
        return  # not writable, or another process made it first
    for name in os.listdir(SEED):
        if not name.startswith("fontlist-"):
            continue
        try:
            with open(os.path.join(SEED, name), "rb") as src:
                data = src.read()
            with open(os.path.join(dst, name), "xb") as out:
                out.write(data)
        except OSError:
            pass


try:
    _seed()
except Exception:  # noqa: BLE001 - Python's start must never fail because of this
    pass
