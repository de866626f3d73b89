"""Errors raised by the CUDA-on-CPU emulator (kernel bugs, not user errors)."""

from __future__ import annotations


class EmuError(RuntimeError):
    """Base class: compile errors, unknown kernels, anything the emulator refuses."""


class EmuLaunchError(EmuError):
    """A launch CUDA would reject or a kernel fault (bad config, bad arguments, invalid access, trap)."""


class EmuDeadlockError(EmuError):
    """No thread of a block can proceed: divergent barrier or collective, or a thread exited while others wait."""
