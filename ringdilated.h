// The umbrella header: the whole public API of RingDilated.
#pragma once

#include "ringdilated/kernels/dtype.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/half.h"
#include "ringdilated/nn/optimizer.h"
#include "ringdilated/tensor/allocator.h"
#include "ringdilated/tensor/autograd.h"
#include "ringdilated/tensor/checkpoint.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/generator.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/safetensors.h"
#include "ringdilated/tensor/tensor.h"
