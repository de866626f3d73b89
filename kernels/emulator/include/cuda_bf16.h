// cudaemu shim for <cuda_bf16.h>: everything is provided by the force-included cudaemu.h.
#pragma once
#include "../cudaemu.h"
