// cudaemu shim for <math_constants.h>: everything is provided by the force-included cudaemu.h.
#pragma once
#include "../cudaemu.h"
