"""The seccomp tier's deny-list is built fail-closed: a syscall name libseccomp does not know
stops the build with the name (skipping it would leave a hole nobody sees); names of other
architectures' syscalls are left out; the real list builds into a BPF program."""

from __future__ import annotations

import pytest

from plait.sandbox.supervisor import DENIED_SYSCALLS, InfraError, seccomp_filter_file


pytest.importorskip("pyseccomp")


def test_an_unknown_syscall_name_is_refused_with_its_name(tmp_path):
    with pytest.raises(InfraError, match="no syscall named ptrace_typo"):
        seccomp_filter_file(str(tmp_path), ("ptrace", "ptrace_typo"))
    assert not (tmp_path / "seccomp.bpf").exists()  # nothing half-built is left to load


def test_the_deny_list_builds(tmp_path):
    (tmp_path / "all").mkdir()
    (tmp_path / "one").mkdir()
    path = seccomp_filter_file(str(tmp_path / "all"), DENIED_SYSCALLS)
    fewer = seccomp_filter_file(str(tmp_path / "one"), ("ptrace",))
    with open(path, "rb") as a, open(fewer, "rb") as b:
        full, one = a.read(), b.read()
    assert len(full) % 8 == 0 and len(full) > len(one) > 0  # BPF instructions are 8 bytes; each rule adds some


def test_a_syscall_only_other_architectures_have_is_left_out(tmp_path):
    import pyseccomp as sc

    other = next(
        (
            n
            for n in ("iopl", "ioperm", "arm_fadvise64_64", "s390_runtime_instr", "cacheflush")
            if sc.resolve_syscall(sc.Arch.NATIVE, n) < -1
        ),
        None,
    )
    if other is None:
        pytest.skip("every candidate exists on this architecture")
    seccomp_filter_file(str(tmp_path), ("ptrace", other))  # no error: nothing to deny here
