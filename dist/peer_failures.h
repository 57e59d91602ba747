// Internal to rd_dist: how a backend learns from the job's store which other rank failed
// first (its own record, or its departure), shared by the NCCL and Gloo communicators.
#pragma once

#include <optional>
#include <string>

#include "ringdilated/dist/tcp_store.h"

namespace rd::dist {

// What the store says about the first other rank that failed.
struct PeerFailure {
  // True: `text` is the value that rank stored under the caller's record prefix, in the
  // backend's own format. False: no rank recorded a failure and `text` is a message saying
  // which rank left, or that the store (rank 0, which serves it) is unreachable.
  bool recorded = false;
  std::string text;
};

// The first failure of a rank other than `own_rank`: a non-empty record under
// `record_prefix` + rank (in the order they were set), else a rank whose process left
// (TcpStore::kLeftPrefix). A store that cannot be read is itself the failure: rank 0 is gone.
// Nullopt when the store knows of no failure yet; never throws for the store's errors.
std::optional<PeerFailure> first_peer_failure(TcpStore& store, const std::string& record_prefix,
                                              int own_rank);

}  // namespace rd::dist
