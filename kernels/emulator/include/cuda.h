// cudaemu shim for <cuda.h>: everything is provided by the force-included cudaemu.h.
#pragma once
#include "../cudaemu.h"
