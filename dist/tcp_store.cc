// The TCP store (see tcp_store.h): a length-prefixed request/reply protocol over TCP, a server
// that runs one poll(2) loop on its own thread, and clients with a connection pool. A get or
// wait that cannot be answered yet parks its connection on the server, which replies when the
// keys arrive or, at the request's deadline, with "timed out" (so client and server never
// disagree about where a connection's byte stream stands).
#include "ringdilated/dist/tcp_store.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <list>
#include <map>
#include <optional>
#include <thread>

#include "ringdilated/kernels/error.h"

namespace rd::dist {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

enum Op : uint8_t { kHello = 1, kSet, kGet, kWait, kCheck, kList };
enum Status : uint8_t { kOk = 0, kTimedOut = 1 };

// A frame is a 4-byte little-endian length, then that many bytes. Bigger frames mean a
// confused peer (or something that is not a store client), not a real request.
constexpr size_t kMaxFrame = size_t{256} << 20;
// How much longer than a get/wait's own timeout a client waits for the server's reply.
constexpr milliseconds kReplyGrace{5000};

std::string errno_str(int err) { return std::strerror(err); }

// --- encoding ----------------------------------------------------------------------------

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
void put_i64(std::string& out, int64_t v) {
  const auto u = static_cast<uint64_t>(v);
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((u >> (8 * i)) & 0xFF));
}
void put_str(std::string& out, const std::string& s) {
  put_u32(out, static_cast<uint32_t>(s.size()));
  out += s;
}
std::string framed(const std::string& body) {
  std::string out;
  put_u32(out, static_cast<uint32_t>(body.size()));
  return out + body;
}

// Reads fields from a frame body; any read past the end sets `bad` and returns zeros.
class Reader {
 public:
  explicit Reader(std::string_view data) : data_(data) {}
  bool bad() const { return bad_; }
  uint8_t u8() { return need(1) ? static_cast<uint8_t>(data_[pos_++]) : 0; }
  uint32_t u32() { return static_cast<uint32_t>(little_endian(4)); }
  int64_t i64() { return static_cast<int64_t>(little_endian(8)); }
  std::string str() {
    const uint32_t n = u32();
    if (!need(n)) return {};
    std::string s(data_.substr(pos_, n));
    pos_ += n;
    return s;
  }
  std::vector<std::string> strs() {
    const uint32_t n = u32();
    if (n > data_.size()) bad_ = true;  // each string takes at least 4 bytes
    if (bad_) return {};
    std::vector<std::string> out(n);
    for (size_t i = 0; i < out.size() && !bad_; ++i) out[i] = str();
    return out;
  }

 private:
  bool need(size_t n) {
    if (bad_ || data_.size() - pos_ < n) bad_ = true;
    return !bad_;
  }
  uint64_t little_endian(int bytes) {
    if (!need(static_cast<size_t>(bytes))) return 0;
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) {
      v |= uint64_t{static_cast<uint8_t>(data_[pos_ + static_cast<size_t>(i)])} << (8 * i);
    }
    pos_ += static_cast<size_t>(bytes);
    return v;
  }

  std::string_view data_;
  size_t pos_ = 0;
  bool bad_ = false;
};

// The body of a complete frame at the front of `buffer`, removed from it; nullopt when the
// frame is not complete yet. Sets `bad` on an oversized frame.
std::optional<std::string> take_frame(std::string& buffer, bool& bad) {
  if (buffer.size() < 4) return std::nullopt;
  Reader header(std::string_view(buffer).substr(0, 4));
  const uint32_t n = header.u32();
  if (n > kMaxFrame) {
    bad = true;
    return std::nullopt;
  }
  if (buffer.size() < 4 + size_t{n}) return std::nullopt;
  std::string body = buffer.substr(4, n);
  buffer.erase(0, 4 + size_t{n});
  return body;
}

// --- sockets -----------------------------------------------------------------------------

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  int get() const { return fd_; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

void set_nodelay(int fd) {
  int on = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
}

int millis_until(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
}

std::string endpoint(const std::string& host, int port) {
  return host.find(':') != std::string::npos ? str_cat("[", host, "]:", port)
                                             : str_cat(host, ":", port);
}

struct AddrInfoDeleter {
  void operator()(addrinfo* a) const { ::freeaddrinfo(a); }
};
using AddrInfo = std::unique_ptr<addrinfo, AddrInfoDeleter>;

AddrInfo resolve(const std::string& host, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* result = nullptr;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &result);
  RD_CHECK(rc == 0, kInvalidArgument, "tcp store: cannot resolve host '", host,
           "': ", ::gai_strerror(rc));
  return AddrInfo(result);
}

// One non-blocking connect attempt to each address of host:port, each bounded by `deadline`.
// Returns the connected socket, or an invalid Fd with `error` set.
Fd try_connect(const std::string& host, int port, Clock::time_point deadline, int& error) {
  const AddrInfo addrs = resolve(host, port, false);
  for (const addrinfo* a = addrs.get(); a != nullptr; a = a->ai_next) {
    Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
    if (fd.get() < 0) {
      error = errno;
      continue;
    }
    set_nonblocking(fd.get());
    if (::connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        error = errno;
        continue;
      }
      pollfd p{fd.get(), POLLOUT, 0};
      if (::poll(&p, 1, millis_until(deadline)) != 1) {
        error = ETIMEDOUT;
        continue;
      }
      socklen_t len = sizeof(error);
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &len);
      if (error != 0) continue;
    }
    set_nodelay(fd.get());
    return fd;
  }
  return Fd();
}

}  // namespace

// --- the server --------------------------------------------------------------------------

class TcpStore::Server {
 public:
  Server(const std::string& host, int port, milliseconds linger) : linger_(linger) {
    const AddrInfo addrs = resolve(host, port, true);
    int error = 0;
    for (const addrinfo* a = addrs.get(); a != nullptr && listen_.get() < 0; a = a->ai_next) {
      Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
      int on = 1;
      if (fd.get() >= 0 && ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on)) == 0 &&
          ::bind(fd.get(), a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd.get(), 128) == 0) {
        listen_ = std::move(fd);
      } else {
        error = errno;
      }
    }
    RD_CHECK(listen_.get() >= 0, kIo, "tcp store: cannot serve on ", endpoint(host, port), ": ",
             errno_str(error));
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    ::getsockname(listen_.get(), reinterpret_cast<sockaddr*>(&bound), &len);
    port_ =
        ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port
                                          : reinterpret_cast<const sockaddr_in*>(&bound)->sin_port);
    set_nonblocking(listen_.get());
    int pipe_fds[2];
    RD_CHECK(::pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) == 0, kIo,
             "tcp store: pipe: ", errno_str(errno));
    wake_read_ = Fd(pipe_fds[0]);
    wake_write_ = Fd(pipe_fds[1]);
    thread_ = std::thread([this] { loop(); });
  }

  // Serves on (see TcpStoreOptions::linger) until every connection that announced a rank is
  // gone, or the linger time is up.
  ~Server() {
    linger_until_ = Clock::now() + linger_;
    stop_ = true;
    const char byte = 0;
    (void)!::write(wake_write_.get(), &byte, 1);
    thread_.join();
  }

  int port() const { return port_; }

 private:
  struct Waiter {
    bool is_get = false;
    std::vector<std::string> keys;
    Clock::time_point deadline;
  };
  struct Client {
    Fd fd;
    std::string in, out;
    int rank = -1;
    std::optional<Waiter> waiter;
    bool dead = false;
  };
  struct Entry {
    std::string value;
    uint64_t order = 0;  // when the key was first set
  };

  void loop() {
    std::vector<pollfd> fds;
    std::vector<Client*> polled;
    while (!done_serving()) {
      fds.assign({{listen_.get(), POLLIN, 0}, {wake_read_.get(), POLLIN, 0}});
      polled.clear();
      for (Client& c : clients_) {
        fds.push_back({c.fd.get(), static_cast<short>(POLLIN | (c.out.empty() ? 0 : POLLOUT)), 0});
        polled.push_back(&c);
      }
      ::poll(fds.data(), fds.size(), next_deadline_ms());
      if (done_serving()) break;
      if (fds[1].revents & POLLIN) drain_wakeups();
      if (fds[0].revents & POLLIN) accept_clients();
      for (size_t i = 0; i < polled.size(); ++i) {
        const short ev = fds[i + 2].revents;
        if (ev & (POLLIN | POLLHUP | POLLERR)) read_from(*polled[i]);
        if ((ev & POLLOUT) && !polled[i]->dead) flush(*polled[i]);
      }
      serve_waiters();
      remove_dead_clients();
    }
  }

  bool done_serving() const {
    if (!stop_) return false;
    return Clock::now() >= linger_until_ ||
           std::none_of(clients_.begin(), clients_.end(),
                        [](const Client& c) { return c.rank >= 0 && !c.dead; });
  }

  void drain_wakeups() {
    char bytes[64];
    while (::read(wake_read_.get(), bytes, sizeof(bytes)) > 0) {
    }
  }

  int next_deadline_ms() const {
    std::optional<Clock::time_point> next;
    if (stop_) next = linger_until_;
    for (const Client& c : clients_) {
      if (c.waiter && (!next || c.waiter->deadline < *next)) next = c.waiter->deadline;
    }
    return next ? millis_until(*next) : -1;
  }

  void accept_clients() {
    for (;;) {
      Fd fd(::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (fd.get() < 0) return;
      set_nodelay(fd.get());
      clients_.emplace_back().fd = std::move(fd);
    }
  }

  void read_from(Client& c) {
    char buffer[65536];
    for (;;) {
      const ssize_t n = ::recv(c.fd.get(), buffer, sizeof(buffer), 0);
      if (n > 0) {
        c.in.append(buffer, static_cast<size_t>(n));
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) break;
      c.dead = true;  // EOF or a reset: the client is gone
      return;
    }
    process(c);
  }

  // Handles the complete requests in c.in, one at a time: a parked get/wait holds the rest.
  void process(Client& c) {
    while (!c.dead && !c.waiter) {
      bool bad = false;
      std::optional<std::string> body = take_frame(c.in, bad);
      if (bad) c.dead = true;
      if (!body) return;
      handle(c, *body);
    }
  }

  void handle(Client& c, const std::string& body) {
    Reader r(body);
    const uint8_t op = r.u8();
    std::string reply(1, static_cast<char>(kOk));
    if (op == kHello) {
      const int64_t rank = r.i64();
      if (!r.bad()) c.rank = static_cast<int>(rank);
    } else if (op == kSet) {
      std::string key = r.str(), value = r.str();
      if (!r.bad()) set(key, std::move(value));
    } else if (op == kGet || op == kWait) {
      Waiter w;
      w.is_get = op == kGet;
      w.keys = w.is_get ? std::vector<std::string>{r.str()} : r.strs();
      w.deadline = Clock::now() + milliseconds(r.i64());
      if (!r.bad()) c.waiter = std::move(w);  // answered by serve_waiters()
    } else if (op == kCheck) {
      reply.push_back(static_cast<char>(all_set(r.strs())));
    } else if (op == kList) {
      append_list(reply, r.str());
    } else {
      c.dead = true;  // not a store client, or a different protocol
    }
    if (r.bad()) c.dead = true;
    if (!c.dead && !c.waiter) send(c, reply);
  }

  void set(const std::string& key, std::string value) {
    auto [it, inserted] = data_.try_emplace(key);
    if (inserted) it->second.order = next_order_++;
    it->second.value = std::move(value);
  }

  bool all_set(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(),
                       [&](const std::string& k) { return data_.count(k) != 0; });
  }

  void append_list(std::string& reply, const std::string& prefix) const {
    std::vector<const std::pair<const std::string, Entry>*> found;
    for (auto it = data_.lower_bound(prefix);
         it != data_.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it) {
      found.push_back(&*it);
    }
    std::sort(found.begin(), found.end(),
              [](const auto* a, const auto* b) { return a->second.order < b->second.order; });
    put_u32(reply, static_cast<uint32_t>(found.size()));
    for (const auto* kv : found) {
      put_str(reply, kv->first);
      put_str(reply, kv->second.value);
    }
  }

  // Answers parked requests whose keys arrived (or whose deadline passed), then lets their
  // connections go on with any requests queued behind them.
  // Requests queued behind an answered one may park or set keys in turn: repeat until quiet.
  void serve_waiters() {
    for (bool progress = true; progress;) {
      progress = false;
      const Clock::time_point now = Clock::now();
      for (Client& c : clients_) {
        if (!c.waiter || c.dead) continue;
        std::string reply;
        if (all_set(c.waiter->keys)) {
          reply.push_back(static_cast<char>(kOk));
          if (c.waiter->is_get) put_str(reply, data_.at(c.waiter->keys[0]).value);
        } else if (now >= c.waiter->deadline) {
          reply.push_back(static_cast<char>(kTimedOut));
        } else {
          continue;
        }
        c.waiter.reset();
        send(c, reply);
        process(c);
        progress = true;
      }
    }
  }

  void send(Client& c, const std::string& body) {
    c.out += framed(body);
    flush(c);
  }

  void flush(Client& c) {
    while (!c.out.empty()) {
      const ssize_t n = ::send(c.fd.get(), c.out.data(), c.out.size(), MSG_NOSIGNAL);
      if (n > 0) {
        c.out.erase(0, static_cast<size_t>(n));
      } else {
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
        c.dead = true;
        return;
      }
    }
  }

  // A closed connection that announced a rank leaves a record: its process is gone.
  void remove_dead_clients() {
    bool left = false;
    for (auto it = clients_.begin(); it != clients_.end();) {
      if (!it->dead) {
        ++it;
        continue;
      }
      if (it->rank >= 0) {
        set(TcpStore::left_key(it->rank), "");
        left = true;
      }
      it = clients_.erase(it);
    }
    if (left) serve_waiters();
  }

  Fd listen_, wake_read_, wake_write_;
  int port_ = 0;
  milliseconds linger_;
  Clock::time_point linger_until_;  // written before stop_ is set, read after it was seen
  std::atomic<bool> stop_{false};
  std::list<Client> clients_;
  std::map<std::string, Entry> data_;
  uint64_t next_order_ = 0;
  std::thread thread_;
};

// --- the client --------------------------------------------------------------------------

struct TcpStore::Reply {
  Status status = kOk;
  std::string body;  // after the status byte
};

class TcpStore::Connection {
 public:
  explicit Connection(Fd fd) : fd_(std::move(fd)) {}

  // Sends a request and waits for its reply until `deadline`. Throws kIo when the connection
  // breaks, kTimeout when no reply came; either way the connection is then unusable.
  Reply request(const std::string& address, const std::string& what, const std::string& body,
                Clock::time_point deadline) {
    const std::string frame = framed(body);
    size_t sent = 0;
    while (sent < frame.size()) {
      const ssize_t n = ::send(fd_.get(), frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
      if (n > 0) {
        sent += static_cast<size_t>(n);
      } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
        await(POLLOUT, address, what, deadline);
      } else {
        broken(address, what, errno);
      }
    }
    std::string in;
    for (;;) {
      bool bad = false;
      if (std::optional<std::string> reply = take_frame(in, bad)) {
        RD_CHECK(!reply->empty(), kIo, "tcp store ", address, ": ", what, ": empty reply");
        return {static_cast<Status>((*reply)[0]), reply->substr(1)};
      }
      RD_CHECK(!bad, kIo, "tcp store ", address, ": ", what, ": malformed reply");
      char buffer[65536];
      const ssize_t n = ::recv(fd_.get(), buffer, sizeof(buffer), 0);
      if (n > 0) {
        in.append(buffer, static_cast<size_t>(n));
      } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
        await(POLLIN, address, what, deadline);
      } else {
        broken(address, what, n == 0 ? 0 : errno);
      }
    }
  }

  // Connects to host:port, retrying until `deadline` when `retry` (the server may not be up
  // yet), else trying once.
  static std::unique_ptr<Connection> open(const std::string& host, int port, bool retry,
                                          Clock::time_point deadline,
                                          milliseconds connect_timeout) {
    int error = 0;
    milliseconds pause{20};
    for (;;) {
      Fd fd = try_connect(host, port, deadline, error);
      if (fd.get() >= 0) return std::make_unique<Connection>(std::move(fd));
      RD_CHECK(retry, kIo, "tcp store: cannot connect to ", endpoint(host, port), ": ",
               errno_str(error), " (the process serving the store, rank 0, may have exited)");
      const Clock::time_point now = Clock::now();
      RD_CHECK(now < deadline, kTimeout, "tcp store: could not connect to ", endpoint(host, port),
               " within ", connect_timeout.count(), " ms (last error: ", errno_str(error),
               "): is rank 0 running, and do all ranks name the same ",
               "MASTER_ADDR and MASTER_PORT?");
      std::this_thread::sleep_for(std::min<Clock::duration>(pause, deadline - now));
      pause = std::min(pause * 2, milliseconds(500));
    }
  }

 private:
  void await(short events, const std::string& address, const std::string& what,
             Clock::time_point deadline) {
    pollfd p{fd_.get(), events, 0};
    const int rc = ::poll(&p, 1, millis_until(deadline));
    RD_CHECK(rc != 0, kTimeout, "tcp store ", address, ": ", what,
             ": no reply from the store before the deadline");
  }

  [[noreturn]] void broken(const std::string& address, const std::string& what, int err) {
    RD_FAIL(kIo, "tcp store ", address, ": ", what, ": the connection to the store broke (",
            err == 0 ? std::string("closed by the server") : errno_str(err),
            "); the process serving it, rank 0, may have exited");
  }

  Fd fd_;
};

// --- TcpStore ----------------------------------------------------------------------------

TcpStore::TcpStore(TcpStoreOptions options) : options_(std::move(options)) {
  RD_CHECK(options_.port >= 0 && options_.port <= 65535, kInvalidArgument,
           "TcpStore: option 'port' must be in [0, 65535], got ", options_.port);
  RD_CHECK(options_.is_server || options_.port > 0, kInvalidArgument,
           "TcpStore: a client needs the server's port, got 0");
  RD_CHECK(options_.timeout.count() > 0 && options_.connect_timeout.count() > 0, kInvalidArgument,
           "TcpStore: options 'timeout' and 'connect_timeout' must be positive");
  RD_CHECK(options_.linger.count() >= 0, kInvalidArgument,
           "TcpStore: option 'linger' must be >= 0 ms, got ", options_.linger.count());
  port_ = options_.port;
  if (options_.is_server) {
    server_ = std::make_unique<Server>(options_.host, options_.port, options_.linger);
    port_ = server_->port();
  }
  std::unique_ptr<Connection> first =
      Connection::open(options_.host, port_, true, Clock::now() + options_.connect_timeout,
                       options_.connect_timeout);
  if (options_.rank < 0) {
    pool_.push_back(std::move(first));
    return;
  }
  std::string hello(1, static_cast<char>(kHello));
  put_i64(hello, options_.rank);
  first->request(address(), "hello", hello, Clock::now() + options_.timeout);
  announced_ = std::move(first);
}

// Connections close before the server stops, so its thread sees them go.
TcpStore::~TcpStore() {
  announced_.reset();
  pool_.clear();
  server_.reset();
}

std::string TcpStore::address() const { return endpoint(options_.host, port_); }

std::string TcpStore::left_key(int rank) { return str_cat(kLeftPrefix, rank); }

TcpStore::Reply TcpStore::call(const std::string& what, const std::string& request,
                               Clock::time_point deadline) {
  std::unique_ptr<Connection> conn;
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    if (!pool_.empty()) {
      conn = std::move(pool_.back());
      pool_.pop_back();
    }
  }
  if (!conn) conn = Connection::open(options_.host, port_, false, deadline, options_.timeout);
  Reply reply = conn->request(address(), what, request, deadline);  // a throw drops conn
  std::lock_guard<std::mutex> lock(pool_mu_);
  pool_.push_back(std::move(conn));
  return reply;
}

void TcpStore::set(const std::string& key, const std::string& value) {
  std::string request(1, static_cast<char>(kSet));
  put_str(request, key);
  put_str(request, value);
  call(str_cat("set '", key, "'"), request, Clock::now() + options_.timeout);
}

std::string TcpStore::get(const std::string& key) { return get(key, options_.timeout); }

std::string TcpStore::get(const std::string& key, milliseconds timeout) {
  std::string request(1, static_cast<char>(kGet));
  put_str(request, key);
  put_i64(request, timeout.count());
  const std::string what = str_cat("get '", key, "'");
  Reply reply = call(what, request, Clock::now() + timeout + kReplyGrace);
  RD_CHECK(reply.status == kOk, kTimeout, "tcp store ", address(), ": ", what, " waited more than ",
           timeout.count(), " ms for the key to be set");
  Reader r(reply.body);
  std::string value = r.str();
  RD_CHECK(!r.bad(), kIo, "tcp store ", address(), ": ", what, ": malformed reply");
  return value;
}

void TcpStore::wait(const std::vector<std::string>& keys) { wait(keys, options_.timeout); }

namespace {

std::string keys_str(const std::vector<std::string>& keys) {
  std::string out;
  for (const std::string& k : keys) out += str_cat(out.empty() ? "'" : ", '", k, "'");
  return out;
}

void put_strs(std::string& out, const std::vector<std::string>& keys) {
  put_u32(out, static_cast<uint32_t>(keys.size()));
  for (const std::string& k : keys) put_str(out, k);
}

}  // namespace

void TcpStore::wait(const std::vector<std::string>& keys, milliseconds timeout) {
  std::string request(1, static_cast<char>(kWait));
  put_strs(request, keys);
  put_i64(request, timeout.count());
  const std::string what = str_cat("wait for ", keys_str(keys));
  Reply reply = call(what, request, Clock::now() + timeout + kReplyGrace);
  RD_CHECK(reply.status == kOk, kTimeout, "tcp store ", address(), ": ", what, " waited more than ",
           timeout.count(), " ms for the keys to be set");
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  std::string request(1, static_cast<char>(kCheck));
  put_strs(request, keys);
  Reply reply = call(str_cat("check ", keys_str(keys)), request, Clock::now() + options_.timeout);
  return !reply.body.empty() && reply.body[0] != 0;
}

std::vector<std::pair<std::string, std::string>> TcpStore::list(const std::string& prefix) {
  std::string request(1, static_cast<char>(kList));
  put_str(request, prefix);
  const std::string what = str_cat("list '", prefix, "'");
  Reply reply = call(what, request, Clock::now() + options_.timeout);
  Reader r(reply.body);
  const uint32_t n = r.u32();
  RD_CHECK(n <= reply.body.size(), kIo, "tcp store ", address(), ": ", what, ": malformed reply");
  std::vector<std::pair<std::string, std::string>> out(n);
  for (auto& [key, value] : out) {
    key = r.str();
    value = r.str();
  }
  RD_CHECK(!r.bad(), kIo, "tcp store ", address(), ": ", what, ": malformed reply");
  return out;
}

}  // namespace rd::dist
