"""A small tmpfs for the full-disk tests: real ENOSPC from every writer (torch.save, Megatron's dist checkpoint).

    with small_fs(path, 512 * 1024) as mounted:   # False where mounting is not permitted: the tests inject instead
"""
import contextlib
import os
import subprocess


@contextlib.contextmanager
def small_fs(path, size_bytes: int):
    os.makedirs(path, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    try:
        yield proc.returncode == 0
    finally:
        if proc.returncode == 0:
            subprocess.run(["umount", "-l", str(path)], check=False)
