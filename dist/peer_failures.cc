// The store lookup of a failed peer shared by the NCCL and Gloo communicators (see
// peer_failures.h).
#include "ringdilated/dist/peer_failures.h"

#include <exception>

#include "ringdilated/kernels/error.h"

namespace rd::dist {

std::optional<PeerFailure> first_peer_failure(TcpStore& store, const std::string& record_prefix,
                                              int own_rank) {
  try {
    const std::string own_record = str_cat(record_prefix, own_rank);
    for (const auto& [key, value] : store.list(record_prefix)) {
      if (key != own_record && !value.empty()) return PeerFailure{true, value};
    }
    const std::string own_left = TcpStore::left_key(own_rank);
    for (const auto& [key, unused] : store.list(TcpStore::kLeftPrefix)) {
      if (key == own_left) continue;
      const std::string rank = key.substr(std::string(TcpStore::kLeftPrefix).size());
      return PeerFailure{false, str_cat("rank ", rank, " left: its process exited or was killed")};
    }
  } catch (const std::exception& e) {
    return PeerFailure{false, str_cat("rank 0, which serves the store at ", store.address(),
                                      ", is unreachable (its process probably exited): ",
                                      e.what())};
  }
  return std::nullopt;
}

}  // namespace rd::dist
