"""CUDA-on-CPU emulator: runs unchanged .cu kernel sources through g++ so CI without a GPU can
execute the project's kernels. Mirrors cupy.RawModule / RawKernel:

    mod = EmuModule(code, name_expressions=("kern<float, 64>",))
    mod.get_function("kern<float, 64>")((grid,), (128,), (out, inp, np.int32(n)), shared_mem=nbytes)

Every CUDA thread is a fiber; __syncthreads and warp collectives are rendezvous points; a block
that cannot make progress raises EmuDeadlockError naming where each thread waits.
"""

from pagedrun.build.cudaemu.build import cache_root
from pagedrun.build.cudaemu.errors import EmuDeadlockError, EmuError, EmuLaunchError
from pagedrun.build.cudaemu.module import EmuKernel, EmuModule

__all__ = ["EmuModule", "EmuKernel", "EmuError", "EmuDeadlockError", "EmuLaunchError", "cache_root"]
