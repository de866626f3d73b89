// cudaemu shim for <sm_30_intrinsics.h>: everything is provided by the force-included cudaemu.h.
#pragma once
#include "../cudaemu.h"
