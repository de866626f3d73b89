// cudaemu shim for <cuda_runtime_api.h>: everything is provided by the force-included cudaemu.h.
#pragma once
#include "../cudaemu.h"
