"""The sandbox's seccomp filter: no new user namespaces, no kernel keyring.

A user namespace gives its creator every capability inside it (mounts, more namespaces),
which reopens the kernel surface the uid switch closed. bubblewrap loads this classic-BPF
program (``bwrap --seccomp FD``) just before it starts the program, for it and everything
it starts:

- ``unshare`` and ``clone`` with ``CLONE_NEWUSER`` in their flags fail with EPERM;
- ``setns`` fails with EPERM (nothing in the sandbox has a reason to join a namespace);
- ``add_key``, ``request_key`` and ``keyctl`` fail with EPERM: the kernel keyring is not
  namespaced by the sandbox's mounts or pid namespace, so every sandbox runs as the same uid
  (65534) would share that uid's user keyring, and a key one sample's program wrote would be
  read by a later sample's (and outlive both);
- ``clone3`` fails with ENOSYS (its flags sit behind a pointer a filter cannot read; the C
  library then falls back to ``clone``, which the filter can check);
- a system call of another ABI (32-bit ``int 0x80``, x32) fails with ENOSYS, since its
  numbers differ and would slip past the checks above.

Everything else is allowed: the filter narrows two doors, the namespaces, uid and limits
of :mod:`rlframe.rewards.sandbox` do the rest.
"""

from __future__ import annotations

import errno
import platform
import struct
from dataclasses import dataclass

CLONE_NEWUSER = 0x10000000
X32_SYSCALL_BIT = 0x40000000

# Classic BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h).
LOAD_WORD = 0x20  # BPF_LD | BPF_W | BPF_ABS
JUMP_EQ = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
JUMP_GE = 0x35  # BPF_JMP | BPF_JGE | BPF_K
JUMP_SET = 0x45  # BPF_JMP | BPF_JSET | BPF_K
RETURN = 0x06  # BPF_RET | BPF_K
ALLOW = 0x7FFF0000
ERRNO = 0x00050000

# Offsets in struct seccomp_data: nr, arch, then args[0] (its low 32 bits: little-endian).
NR, ARCH, ARG0_LOW = 0, 4, 16


@dataclass(frozen=True)
class SyscallTable:
    audit_arch: int
    clone: int
    unshare: int
    setns: int
    keyring: tuple[int, int, int]
    """add_key, request_key, keyctl."""
    clone3: int = 435


TABLES = {
    "x86_64": SyscallTable(0xC000003E, clone=56, unshare=272, setns=308, keyring=(248, 249, 250)),
    "aarch64": SyscallTable(0xC00000B7, clone=220, unshare=97, setns=268, keyring=(217, 218, 219)),
}


def instruction(code: int, k: int, jump_true: int = 0, jump_false: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jump_true, jump_false, k)


def build_filter(machine: str | None = None) -> bytes | None:
    """The filter for this machine's architecture (``platform.machine()``), or None where
    its system call numbers are not known here."""
    table = TABLES.get(machine or platform.machine())
    if table is None:
        return None
    deny = ERRNO | errno.EPERM
    missing = ERRNO | errno.ENOSYS
    # Jumps are relative: an offset j from instruction i lands on i + 1 + j.
    add_key, request_key, keyctl = table.keyring
    program = [
        instruction(LOAD_WORD, ARCH),  # 0
        instruction(JUMP_EQ, table.audit_arch, 1, 0),  # 1: this ABI -> 3
        instruction(RETURN, missing),  # 2: another ABI
        instruction(LOAD_WORD, NR),  # 3
        instruction(JUMP_GE, X32_SYSCALL_BIT, 12, 0),  # 4: x32 -> 17
        instruction(JUMP_EQ, table.unshare, 7, 0),  # 5: -> 13
        instruction(JUMP_EQ, table.clone, 6, 0),  # 6: -> 13
        instruction(JUMP_EQ, table.clone3, 9, 0),  # 7: -> 17
        instruction(JUMP_EQ, table.setns, 6, 0),  # 8: -> 15
        instruction(JUMP_EQ, add_key, 5, 0),  # 9: -> 15
        instruction(JUMP_EQ, request_key, 4, 0),  # 10: -> 15
        instruction(JUMP_EQ, keyctl, 3, 0),  # 11: -> 15
        instruction(RETURN, ALLOW),  # 12
        instruction(LOAD_WORD, ARG0_LOW),  # 13: the flags of unshare or clone
        instruction(JUMP_SET, CLONE_NEWUSER, 0, 1),  # 14: set -> 15, else -> 16
        instruction(RETURN, deny),  # 15
        instruction(RETURN, ALLOW),  # 16
        instruction(RETURN, missing),  # 17
    ]
    return b"".join(program)
