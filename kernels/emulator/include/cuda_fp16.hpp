// cudaemu shim for <cuda_fp16.hpp>: everything is provided by the force-included cudaemu.h.
#pragma once
#include "../cudaemu.h"
