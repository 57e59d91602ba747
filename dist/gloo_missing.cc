// Stands in for gloo.cc in builds without Gloo (libgloo-dev not found when configuring): the
// backend reports itself missing instead of leaving its functions undefined.
#include "ringdilated/dist/gloo.h"

#include "ringdilated/kernels/error.h"

namespace rd::dist {

bool gloo_available() { return false; }

std::shared_ptr<Communicator> make_gloo_communicator(std::shared_ptr<TcpStore> /*store*/,
                                                     int /*rank*/, int /*size*/,
                                                     const GlooOptions& /*options*/) {
  RD_FAIL(kUnimplemented,
          "make_gloo_communicator: this build of RingDilated has no Gloo backend (libgloo-dev "
          "was not found when it was configured; install it and reconfigure)");
}

}  // namespace rd::dist
