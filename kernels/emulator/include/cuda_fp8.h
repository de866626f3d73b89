// cudaemu shim for <cuda_fp8.h>: everything is provided by the force-included cudaemu.h (cudaemu_fp8.h).
#pragma once
#include "../cudaemu.h"
