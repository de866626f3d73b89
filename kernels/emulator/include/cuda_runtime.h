// cudaemu shim for <cuda_runtime.h>: everything is provided by the force-included cudaemu.h.
#pragma once
#include "../cudaemu.h"
