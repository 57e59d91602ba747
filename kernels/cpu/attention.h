// The CPU reference ("math") attention: the primitive of kernels/attention.h on host memory,
// forward and accumulating backward, against which every faster path is compared.
#pragma once

#include "ringdilated/kernels/attention.h"

namespace rd::kernels::cpu {

// Writes out (and lse when lse.data is set). Keys are visited in tiles with an online
// softmax, so memory stays O(rows * D) whatever Lk is. Checks its arguments first
// (check_attention_forward_args). Results do not depend on the thread count.
void attention_forward(const AttentionForwardArgs& args);

// Adds the gradients of one forward call to grad_q, grad_k and grad_v (see
// AttentionBackwardArgs). Each output row is owned by one task (query rows for grad_q, key
// rows for grad_k/grad_v), so there are no races and results do not depend on the thread
// count.
void attention_backward(const AttentionBackwardArgs& args);

}  // namespace rd::kernels::cpu
