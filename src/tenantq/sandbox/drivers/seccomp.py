"""The process driver's system-call filter (docs/security.md, rule P2).

Under bubblewrap a job's system calls reach the host kernel, so the calls
that let one sandbox process reach into another (ptrace, process_vm_*,
pidfd_getfd, kcmp), create namespaces (a nested user namespace would give
the job every capability inside it, and mount()), or widen the kernel's
attack surface (bpf, perf_event_open, userfaultfd, io_uring, keyrings,
module and kexec loading, new mount API) fail with EPERM. clone3 fails
with ENOSYS so that libc falls back to clone, whose flags the filter can
see (clone3 passes them in memory a BPF filter cannot read). Built with
libseccomp (through pyseccomp) and handed to bwrap as a compiled program.
"""

from __future__ import annotations

import errno
import os
import tempfile
from functools import cache

DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "mount_setattr",
    "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree",
    "open_by_handle_at", "name_to_handle_at",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key", "init_module", "finit_module", "delete_module",
    "kexec_load", "kexec_file_load", "acct", "swapon", "swapoff", "reboot", "syslog",
    "quotactl", "lookup_dcookie", "iopl", "ioperm", "personality", "vhangup",
)
NAMESPACE_FLAGS = (
    0x10000000,  # CLONE_NEWUSER
    0x00020000,  # CLONE_NEWNS
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x02000000,  # CLONE_NEWCGROUP
    0x00000080,  # CLONE_NEWTIME
)


@cache
def program() -> bytes:
    """The compiled BPF program (built once per process)."""
    import pyseccomp as seccomp

    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in DENIED:
        rules.add_rule(seccomp.ERRNO(errno.EPERM), name)
    for flag in NAMESPACE_FLAGS:
        rules.add_rule(seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as out:
        rules.export_bpf(out)
        out.seek(0)
        return out.read()


def program_fd() -> int:
    """A readable fd holding the program, for `bwrap --seccomp FD` (the
    caller passes it to the child and closes it)."""
    read_end, write_end = os.pipe()
    data = program()
    # 8 bytes per BPF instruction: a few hundred bytes, far under a pipe's buffer
    os.write(write_end, data)
    os.close(write_end)
    return read_end
