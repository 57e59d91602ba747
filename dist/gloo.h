// The Gloo communicator: one process per rank, CPU tensors, over Gloo's TCP transport, with a
// TcpStore for the rendezvous and for telling the ranks which rank failed first. Usually built
// by init_process_group (bootstrap.h) from the launcher's environment.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "ringdilated/dist/communicator.h"
#include "ringdilated/dist/tcp_store.h"

namespace rd::dist {

struct GlooOptions {
  // How long any wait of any operation (a transfer, a collective's exchange) may take before
  // it fails with kTimeout naming the operation and the rank. The group is then unusable.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // How long building the group (the store rendezvous and connecting every pair of ranks) may
  // take before it fails with kTimeout; split() uses it too.
  std::chrono::milliseconds rendezvous_timeout{std::chrono::minutes(5)};
  // The address this rank's connections listen on: one the other ranks can reach.
  std::string hostname = "127.0.0.1";
  // After a connection to a peer broke, how long a rank looks in the store for the failure
  // record of the rank that failed first (an abort, a timeout, a process that left), so that
  // its error can name that rank.
  std::chrono::milliseconds failure_lookup{std::chrono::seconds(2)};
};

// Whether this build has the Gloo backend (it is left out when libgloo-dev was not found).
bool gloo_available();

// Rank `rank` of a group of `size` processes that each pass a store connected to the same
// server. Collective: every rank calls it. Failure behaviour:
//   - every wait has options.timeout; a rank that times out records it in the store, so the
//     others fail with kTimeout too instead of a bare "connection closed";
//   - abort(reason) records "rank r aborted: reason" in the store and closes this rank's
//     connections: its own pending and later operations throw kAborted, and the other ranks'
//     operations fail (kAborted) naming rank r and the reason;
//   - a rank whose process exits or is killed closes its connections: the others fail
//     (kAborted) naming it (the store noticed its connection close).
// Gloo writes to sockets without MSG_NOSIGNAL, so the first call sets SIGPIPE to SIG_IGN when
// its disposition is the default (a peer that died would otherwise kill this process).
// Throws kUnimplemented when !gloo_available().
std::shared_ptr<Communicator> make_gloo_communicator(std::shared_ptr<TcpStore> store, int rank,
                                                     int size, const GlooOptions& options = {});

}  // namespace rd::dist
