"""The CPU engine's thread policy (``tts/threads.py``) with fakes: the wait policy set before torch,
the cgroup quota read from a fake filesystem, what other processes and the hypervisor take, the
thread count it leads to, and its re-check while running."""

from __future__ import annotations

from pathlib import Path

import pytest

from s2s_daemon.tts.threads import (
    SPIN_COUNT,
    CpuShare,
    CpuTimes,
    CpuWatch,
    ThreadPolicy,
    ceiling_threads,
    cgroup_quota,
    choose_threads,
    prepare_openmp,
    read_times,
)
from tests.support.wait import until_blocking

# -- the wait policy ------------------------------------------------------------------------


def test_a_short_spin_is_asked_for_before_torch_is_imported() -> None:
    env: dict[str, str] = {}
    assert prepare_openmp(env, imported=False) == "set"
    assert env == {"GOMP_SPINCOUNT": SPIN_COUNT}
    assert 0 < int(SPIN_COUNT) < 300_000  # shorter than libgomp's own spin, not a passive wait


@pytest.mark.parametrize("variable", ["OMP_WAIT_POLICY", "GOMP_SPINCOUNT"])
def test_the_users_own_wait_setting_is_kept(variable: str) -> None:
    env = {variable: "ACTIVE" if variable == "OMP_WAIT_POLICY" else "1000"}
    assert prepare_openmp(env, imported=False) == "kept"
    assert env == {variable: env[variable]}


def test_llvms_blocktime_alone_does_not_keep_libgomp_spinning() -> None:
    env = {"KMP_BLOCKTIME": "200"}  # read by LLVM's and Intel's OpenMP, not by torch's libgomp
    assert prepare_openmp(env, imported=False) == "set"
    assert env == {"KMP_BLOCKTIME": "200", "GOMP_SPINCOUNT": SPIN_COUNT}


def test_after_torch_is_imported_it_is_too_late_and_says_so() -> None:
    env: dict[str, str] = {}
    assert prepare_openmp(env, imported=True) == "late"
    assert env == {}


# -- the cgroup quota -----------------------------------------------------------------------


def _proc(tmp_path: Path, cgroup: str) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    return proc


def test_a_systemd_cpu_quota_on_cgroup_v2_is_read_and_the_smallest_on_the_path_wins(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    service = root / "system.slice" / "s2s.service"
    service.mkdir(parents=True)
    (root / "system.slice" / "cpu.max").write_text("max 100000\n")
    (service / "cpu.max").write_text("150000 100000\n")  # CPUQuota=150%
    proc = _proc(tmp_path, "0::/system.slice/s2s.service\n")
    assert cgroup_quota(proc, root) == pytest.approx(1.5)
    (root / "system.slice" / "cpu.max").write_text("50000 100000\n")  # the slice allows less
    assert cgroup_quota(proc, root) == pytest.approx(0.5)


def test_no_quota_is_none(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    (root / "user.slice").mkdir(parents=True)
    (root / "user.slice" / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(_proc(tmp_path, "0::/user.slice\n"), root) is None
    assert cgroup_quota(tmp_path / "no-proc", root) is None


def test_a_container_limit_on_cgroup_v1_is_read(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    # A container sees its own cgroup at the mount's root, the host's path in /proc/self/cgroup.
    mount = root / "cpu,cpuacct"
    mount.mkdir(parents=True)
    (mount / "cpu.cfs_quota_us").write_text("100000\n")
    (mount / "cpu.cfs_period_us").write_text("100000\n")
    proc = _proc(tmp_path, "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cgroup_quota(proc, root) == pytest.approx(1.0)
    (mount / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_quota(proc, root) is None


# -- what others take, and the count ----------------------------------------------------------


class FakeMachine:
    """CPU seconds that advance as the test says: the machine's busy time, steal, our own."""

    def __init__(self) -> None:
        self.at = 0.0
        self.busy = 0.0
        self.steal = 0.0
        self.own = 0.0

    def advance(self, seconds: float, ours: float, others: float, steal: float = 0.0) -> None:
        """``seconds`` of wall time with ``ours`` and ``others`` CPUs busy and ``steal`` stolen."""
        self.at += seconds
        self.own += ours * seconds
        self.busy += (ours + others) * seconds
        self.steal += steal * seconds

    def read(self) -> CpuTimes:
        return CpuTimes(self.busy, self.steal, self.own, self.at)


def _watch(machine: FakeMachine, cpus: int = 2, quota: float | None = None) -> CpuWatch:
    return CpuWatch(machine.read, lambda: quota, lambda: cpus, interval_s=2.0)


def test_the_watch_counts_other_processes_not_its_own() -> None:
    machine = FakeMachine()
    watch = _watch(machine)
    watch.sample()
    machine.advance(2.0, ours=2.0, others=0.0)
    assert watch.sample().others == pytest.approx(0.0)
    machine.advance(2.0, ours=1.3, others=0.7)  # a busy neighbour took its share
    share = watch.sample()
    assert share.others == pytest.approx(0.7)  # believed at once: the engine yields within a reading
    machine.advance(2.0, ours=1.0, others=1.0, steal=0.4)
    share = watch.sample()
    assert share.others == pytest.approx(1.0) and share.steal == pytest.approx(0.4)
    machine.advance(2.0, ours=2.0, others=0.0)  # it went: believed by a running average
    share = watch.sample()
    assert share.others == pytest.approx(0.5) and share.steal == pytest.approx(0.2)
    machine.advance(2.0, ours=2.0, others=0.0)
    assert watch.sample().others == pytest.approx(0.25)


def test_the_real_proc_stat_reads() -> None:
    first = read_times()
    if first is None:
        pytest.skip("no /proc/stat here")
    assert first.busy_s > 0 and first.steal_s >= 0 and first.own_s > 0


@pytest.mark.parametrize(
    ("share", "threads", "reason"),
    [
        (CpuShare(2), 2, "ceiling"),  # quiet, 2 cores: both
        (CpuShare(2, others=0.7), 1, "load"),  # one busy neighbour
        (CpuShare(2, others=1.0), 1, "load"),
        (CpuShare(2, others=2.5), 1, "load"),  # never fewer than one
        (CpuShare(2, steal=0.9), 1, "steal"),  # the hypervisor takes most of a CPU
        (CpuShare(2, quota=1.0), 1, "ceiling"),  # CPUQuota=100%
        (CpuShare(8), 7, "ceiling"),  # one left for the event loop and audio
        (CpuShare(8, others=3.0), 4, "load"),  # 8 cores, 3 busy neighbours: the 5 left, less one
        (CpuShare(16, quota=4.0), 3, "ceiling"),  # a container's --cpus 4 on a big host, less one
        (CpuShare(16, quota=2.0), 2, "ceiling"),  # --cpus 2: both, as on a 2-core machine
    ],
)
def test_the_count_follows_what_is_free(share: CpuShare, threads: int, reason: str) -> None:
    assert choose_threads(share, ceiling_threads(share, default=64)) == (threads, reason)


def test_the_ceiling_honours_the_quota_and_torchs_own_count() -> None:
    assert ceiling_threads(CpuShare(2), default=2) == 2
    assert ceiling_threads(CpuShare(2, quota=1.5), default=2) == 1
    assert ceiling_threads(CpuShare(2, quota=0.5), default=2) == 1
    assert ceiling_threads(CpuShare(4, quota=2.5), default=4) == 2
    assert ceiling_threads(CpuShare(32), default=4) == 4  # OMP_NUM_THREADS=4


def test_between_the_margins_the_count_stays() -> None:
    ceiling = 2
    assert choose_threads(CpuShare(2, others=0.4), ceiling, current=2)[0] == 2  # 1.6 free: keep 2
    assert choose_threads(CpuShare(2, others=0.4), ceiling, current=1)[0] == 1  # ... and keep 1
    assert choose_threads(CpuShare(2, others=0.6), ceiling, current=2)[0] == 1  # 1.4 free: one
    assert choose_threads(CpuShare(2, others=0.2), ceiling, current=1)[0] == 2  # 1.8 free: two again


def test_the_policy_re_checks_while_running_and_sets_the_count_on_its_thread() -> None:
    machine = FakeMachine()
    watch = _watch(machine)
    clock = [0.0]
    applied: list[int] = []
    policy = ThreadPolicy(None, 2, applied.append, watch, clock=lambda: clock[0])
    assert policy.start() == 2 and applied == [2]
    machine.advance(2.0, ours=2.0, others=0.0)
    watch.sample()
    clock[0] = 2.5
    assert policy.adjust() == 2 and applied == [2]
    # A busy neighbour comes: the next reading sees it, the next frame after it runs one thread.
    machine.advance(2.0, ours=1.3, others=0.7)
    watch.sample()
    assert policy.adjust() == 2  # checked 0 s ago: not before the next reading
    clock[0] = 5.0
    assert policy.adjust() == 1 and applied == [2, 1]
    # It goes: both threads again, once a few readings agree (0.35, then 0.175 busy).
    machine.advance(2.0, ours=1.0, others=0.0)
    watch.sample()
    clock[0] = 7.5
    assert policy.adjust() == 1
    machine.advance(2.0, ours=1.0, others=0.0)
    watch.sample()
    clock[0] = 10.0
    assert policy.adjust() == 2 and applied == [2, 1, 2]
    policy.stop()


def test_a_fixed_count_is_never_changed() -> None:
    applied: list[int] = []
    policy = ThreadPolicy(3, 2, applied.append)
    assert policy.start() == 3 and policy.watch is None
    assert policy.adjust() == 3 and applied == [3]


def test_the_watch_thread_starts_and_stops() -> None:
    machine = FakeMachine()
    watch = CpuWatch(machine.read, lambda: None, lambda: 2, interval_s=0.01)
    watch.start()
    try:
        until_blocking(lambda: watch.readings >= 3, 10, "three readings")
    finally:
        watch.stop()
