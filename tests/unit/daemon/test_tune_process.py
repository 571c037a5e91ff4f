"""What `outbox-relay run` tunes in its process (relay/daemon/lifecycle.py, issue #53)."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

# In a process of its own: the tuning is process-wide. It frees 200 small blocks (more
# than glibc's per-thread cache holds) before and after, and prints how many bytes glibc's
# fastbins then hold (mallinfo2's fsmblks).
_CHURN = textwrap.dedent(
    """
    import ctypes, gc
    from relay.daemon.lifecycle import tune_process

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Info
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    def fastbin_bytes():
        for block in [libc.malloc(48) for _ in range(200)]:
            libc.free(block)
        return libc.mallinfo2().fsmblks

    before = fastbin_bytes()
    tune_process()
    print(before, fastbin_bytes(), gc.get_threshold()[0])
    """
)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")
def test_the_relay_turns_glibcs_fastbins_off_and_the_collector_down() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHURN], capture_output=True, text=True, check=True
    ).stdout
    before, after, threshold = map(int, out.split())
    assert before > 0, "the churn fills the fastbins of an untuned process"
    assert after == 0, "no fastbins once tuned: nothing for glibc to merge on a large free"
    assert threshold == 50_000
