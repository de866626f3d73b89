"""The launch record handed to a compiled emulator library (one C struct, shared by the in-process
launcher in module.py and the AddressSanitizer child in asan.py, so it lives below both)."""

from __future__ import annotations

import ctypes


class LaunchCfg(ctypes.Structure):  # mirrors cudaemu::LaunchCfg in kernels/emulator/cudaemu_runtime.h
    _fields_ = [
        ("grid", ctypes.c_uint32 * 3),
        ("block", ctypes.c_uint32 * 3),
        ("shared_mem", ctypes.c_uint64),
        ("schedule", ctypes.c_int32),
        ("poison_shared", ctypes.c_int32),
        ("stack_bytes", ctypes.c_uint64),
        ("timeout_s", ctypes.c_double),
        ("kernel_name", ctypes.c_char_p),
        ("err", ctypes.c_void_p),
        ("err_len", ctypes.c_uint64),
    ]
