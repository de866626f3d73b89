// cudaemu shim for <vector_functions.h>: everything is provided by the force-included cudaemu.h.
#pragma once
#include "../cudaemu.h"
