// cudaemu shim for <device_launch_parameters.h>: everything is provided by the force-included cudaemu.h.
#pragma once
#include "../cudaemu.h"
