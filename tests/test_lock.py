"""One writer per output directory (``outputs/lock.py``): a second holder is refused naming the first, the
lock goes with its process however that process ends, and ``holder`` says who holds it."""

import os
import signal
import subprocess
import sys

import pytest

from fedrod_ray.outputs.lock import LOCK_FILE, DirectoryInUse, exclusive, holder


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    """Refused at once, naming the holder, on one process's two opens as on two processes'."""
    run_dir = tmp_path / "new" / "run"
    assert holder(run_dir) is None
    with exclusive(run_dir):  # creates the directory
        held_by = holder(run_dir)
        assert held_by.startswith(f"pid {os.getpid()} on ") and " since " in held_by
        with (pytest.raises(DirectoryInUse, match=f"{run_dir} is in use by pid {os.getpid()} on .*; wait for it"),
              exclusive(run_dir)):
            pass
        assert holder(run_dir) == held_by  # the refused one wrote nothing
    assert holder(run_dir) is None
    assert not (tmp_path / "new").exists()  # created for the lock, left empty: removed with its parent
    with exclusive(run_dir):  # free again once released
        assert holder(run_dir).startswith(f"pid {os.getpid()} ")
        (run_dir / "config.yaml").write_text("{}")
    assert (run_dir / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} ")  # it stays, saying who held it last
    with pytest.raises(ZeroDivisionError), exclusive(run_dir):
        raise ZeroDivisionError
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE, "config.yaml"]  # a directory it found stays


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    code = ("import sys, time\nfrom fedrod_ray.outputs.lock import exclusive\n"
            f"with exclusive({str(tmp_path)!r}):\n    print('held', flush=True)\n    time.sleep(600)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "held\n"
        assert holder(tmp_path).startswith(f"pid {child.pid} on ")
        with pytest.raises(DirectoryInUse, match=f"in use by pid {child.pid} "), exclusive(tmp_path):
            pass
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert holder(tmp_path) is None
    with exclusive(tmp_path):
        pass


def test_a_child_forked_without_exec_does_not_keep_the_lock(tmp_path):
    to_child, from_child = os.pipe(), os.pipe()
    with exclusive(tmp_path):
        pid = os.fork()
        if pid == 0:  # the child: says it runs (past the fork's hooks), then lives on until told to end
            os.write(from_child[1], b"r")
            os.read(to_child[0], 1)
            os._exit(0)
        assert os.read(from_child[0], 1) == b"r"
    try:
        assert holder(tmp_path) is None  # released with the parent's block, the child still alive
        with exclusive(tmp_path):
            assert holder(tmp_path).startswith(f"pid {os.getpid()} ")
    finally:
        os.write(to_child[1], b"x")
        os.waitpid(pid, 0)
        for fd in (*to_child, *from_child):
            os.close(fd)
