// A small TCP key-value store for bootstrapping process groups: rank 0 serves it on
// MASTER_ADDR:MASTER_PORT and every rank (rank 0 too) is a client. Gloo's rendezvous runs over
// it, and through it a rank whose connection to a peer broke learns which rank failed first.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace rd::dist {

struct TcpStoreOptions {
  std::string host = "127.0.0.1";  // the server's address: a name or a numeric IPv4/IPv6 address
  int port = 0;                    // the server's port; a server given 0 picks a free one
  bool is_server = false;          // serve on host:port (and be a client of that server too)
  // The rank this process announces. When its connection closes (the process exited, was
  // killed, or destroyed its store), the server sets left_key(rank): that is how the other
  // ranks learn that it is gone. -1 announces nothing.
  int rank = -1;
  // How long the constructor keeps retrying to reach the server before it fails with kTimeout
  // naming the address: the rendezvous timeout (rank 0 may start after the others).
  std::chrono::milliseconds connect_timeout{std::chrono::minutes(5)};
  // How long get() and wait() wait for keys, and any request for its reply, before kTimeout.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // How long a server, once destroyed, keeps serving while processes that announced a rank
  // are still connected. A rank whose connection to a peer broke reads in the store which
  // rank failed first; rank 0, which serves it, often ends on that same failure before the
  // others have read it, and they would blame rank 0 instead.
  std::chrono::milliseconds linger{std::chrono::seconds(5)};
};

// Thread-safe: every request takes a connection of its own from a pool, so a get() waiting
// for a key never holds up another thread's set(). Values are byte strings. Errors are
// rd::Error naming the store's address and the key: kTimeout (connect, or a key never set),
// kIo (the connection broke: usually the process serving the store exited).
class TcpStore {
 public:
  // Starts the server (is_server) and connects, retrying until connect_timeout.
  explicit TcpStore(TcpStoreOptions options);
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  const TcpStoreOptions& options() const { return options_; }
  int port() const { return port_; }  // the served port (the one picked when given 0)
  std::string address() const;        // "host:port", as messages name it

  void set(const std::string& key, const std::string& value);
  // The key's value, waiting until some client sets it (up to `timeout`, default
  // options().timeout).
  std::string get(const std::string& key);
  std::string get(const std::string& key, std::chrono::milliseconds timeout);
  // Returns once every key is set.
  void wait(const std::vector<std::string>& keys);
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  // Whether every key is set now; never waits.
  bool check(const std::vector<std::string>& keys);
  // Every key that starts with `prefix`, with its value, in the order the keys were first set.
  std::vector<std::pair<std::string, std::string>> list(const std::string& prefix);

  // The key the server sets (to "") when the connection of a process announcing `rank` closes.
  static std::string left_key(int rank);
  static constexpr const char* kLeftPrefix = "rd/left/";

 private:
  class Server;
  class Connection;
  struct Reply;

  // Sends one request on a pooled connection and returns the reply; `what` names the request
  // in errors. A connection that failed is dropped, not pooled again.
  Reply call(const std::string& what, const std::string& request,
             std::chrono::steady_clock::time_point deadline);

  TcpStoreOptions options_;
  std::unique_ptr<Server> server_;
  int port_ = 0;
  std::unique_ptr<Connection> announced_;  // the connection that announced options_.rank
  std::mutex pool_mu_;
  std::vector<std::unique_ptr<Connection>> pool_;
};

}  // namespace rd::dist
