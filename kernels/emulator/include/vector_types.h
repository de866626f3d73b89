// cudaemu shim for <vector_types.h>: everything is provided by the force-included cudaemu.h.
#pragma once
#include "../cudaemu.h"
