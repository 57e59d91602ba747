// The NCCL communicator with one rank on one GPU: initialization, every collective, a paired
// send/receive to itself, sub-groups, abort and argument errors, against values computed on
// the host; and ranks that are threads of one process on 2 to 4 GPUs (NcclGroup), where a
// rank that skips a collective is named within the timeout. Runs where a GPU and
// libnccl.so.2 are present (the multi-GPU training runs are their own suite).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "ringdilated/dist/nccl.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/generator.h"
#include "ringdilated/tensor/ops.h"
#include "testing/raises.h"
#include "testing/tensor_util.h"

namespace rd {
namespace {

class NcclOneRank : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!dist::nccl_available(&why)) GTEST_SKIP() << "NCCL unavailable: " << why;
    comm_ = dist::make_nccl_communicator(dist::nccl_unique_id(), 0, 1, Device::cuda(0));
  }

  // Random non-zero values on the GPU, and the same values on the host.
  Tensor random_gpu(const Shape& shape, DType dtype, uint64_t seed) {
    Generator gen(seed);
    return randn(shape, gen, TensorOptions(dtype)).to(Device::cuda(0));
  }

  static void expect_equal(const Tensor& got, const Tensor& want) {
    const test::RefArray g = test::to_ref(got), w = test::to_ref(want);
    ASSERT_EQ(g.shape, w.shape);
    for (int64_t i = 0; i < w.numel(); ++i) ASSERT_EQ(g.data[i], w.data[i]) << "element " << i;
  }

  std::shared_ptr<dist::Communicator> comm_;
};

TEST_F(NcclOneRank, EveryCollectiveIsTheIdentityOnOneRank) {
  EXPECT_EQ(comm_->rank(), 0);
  EXPECT_EQ(comm_->size(), 1);
  EXPECT_EQ(comm_->backend_name(), "nccl");
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat64}) {
    const Tensor in = random_gpu({5, 3}, dtype, 1);
    const TensorOptions opts = TensorOptions(dtype).with_device(Device::cuda(0));
    Tensor gathered = full({1, 5, 3}, NAN, opts);  // poisoned
    comm_->all_gather(gathered, in);
    expect_equal(gathered.select(0, 0), in);
    Tensor scattered = full({5, 3}, NAN, opts);
    comm_->reduce_scatter(scattered, in.unsqueeze(0).contiguous());
    expect_equal(scattered, in);
    Tensor reduced = in.clone();
    comm_->all_reduce(reduced, dist::ReduceOp::kMax);
    expect_equal(reduced, in);
    Tensor broadcast = in.clone();
    comm_->broadcast(broadcast, 0);
    expect_equal(broadcast, in);
  }
  comm_->barrier();
  const dist::CommStats stats = comm_->stats();
  EXPECT_EQ(stats.collectives, 13);  // 4 x 3 dtypes + the barrier
}

TEST_F(NcclOneRank, PairedSendAndReceiveToItself) {
  const Tensor sent = random_gpu({1000}, DType::kFloat32, 2);
  Tensor got = full({1000}, NAN, TensorOptions(DType::kFloat32).with_device(Device::cuda(0)));
  comm_->isendrecv(sent, 0, got, 0)->wait();
  expect_equal(got, sent);
  EXPECT_EQ(comm_->stats().bytes_sent, 4000);
  EXPECT_EQ(comm_->stats().bytes_received, 4000);
}

TEST_F(NcclOneRank, SplitAndAbort) {
  std::shared_ptr<dist::Communicator> sub = comm_->split(3, 0);
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->size(), 1);
  Tensor t = random_gpu({4}, DType::kFloat32, 3);
  const Tensor want = t.clone();
  sub->all_reduce(t);
  expect_equal(t, want);
  comm_->abort("test abort");
  EXPECT_TRUE(test::raises([&] { comm_->barrier(); }, {ErrorCode::kAborted},
                           {"barrier", "rank 0", "test abort"}));
}

TEST_F(NcclOneRank, BadArgumentsNameTheOpAndTheArgument) {
  EXPECT_TRUE(test::raises([&] { comm_->all_reduce(zeros({4})); }, {ErrorCode::kDeviceMismatch},
                           {"all_reduce", "cpu", "nccl"}));
  const Tensor x = random_gpu({4}, DType::kFloat32, 4);
  EXPECT_TRUE(test::raises([&] { comm_->isend(x, 1); }, {ErrorCode::kOutOfRange},
                           {"isend", "peer rank 1"}));
  EXPECT_TRUE(test::raises(
      [&] { dist::make_nccl_communicator("short", 0, 1, Device::cuda(0)); },
      {ErrorCode::kInvalidArgument}, {"make_nccl_communicator", "unique_id", "5 bytes"}));
}

TEST(NcclGroup, OneProcessDrivingItsGpus) {
  std::string why;
  if (!dist::nccl_available(&why)) GTEST_SKIP() << "NCCL unavailable: " << why;
  auto comms = dist::make_nccl_group({Device::cuda(0)});
  ASSERT_EQ(comms.size(), 1u);
  Tensor t = full({8}, 2.5, TensorOptions(DType::kFloat32).with_device(Device::cuda(0)));
  comms[0]->all_reduce(t);
  comms[0]->barrier();
  EXPECT_EQ(test::to_ref(t).data[7], 2.5);
}

// Ranks that are threads (make_nccl_group) wait for each operation on the host, within
// NcclOptions::timeout: when the last rank skips an all_reduce, every other rank fails within
// the timeout with an error naming the operation and the rank that never issued it, and the
// skipping rank's next operation fails too, since the whole group was aborted. With
// `connect_first`, every rank first does one all_reduce together. Needs 2 GPUs (up to 4 are
// used); run with --gtest_filter='NcclGroup.*'.
void expect_skipped_all_reduce_named(bool connect_first) {
  std::string why;
  if (!dist::nccl_available(&why)) GTEST_SKIP() << "NCCL unavailable: " << why;
  const int P = std::min(cuda_device_count(), 4);
  if (P < 2) GTEST_SKIP() << "needs 2 GPUs, " << P << " visible";
  std::vector<Device> devices;
  for (int r = 0; r < P; ++r) devices.push_back(Device::cuda(r));
  dist::NcclOptions options;
  options.timeout = std::chrono::seconds(3);
  const auto comms = dist::make_nccl_group(devices, options);
  const int skipper = P - 1;
  auto all_reduce_on = [&](int r) {
    Generator gen(static_cast<uint64_t>(10 + r));
    Tensor t = randn({1024}, gen, TensorOptions(DType::kFloat32)).to(Device::cuda(r));
    comms[static_cast<size_t>(r)]->all_reduce(t);
  };
  if (connect_first) {
    std::vector<std::thread> threads;
    for (int r = 0; r < P; ++r) threads.emplace_back(all_reduce_on, r);
    for (std::thread& t : threads) t.join();
  }
  std::vector<std::string> errors(static_cast<size_t>(P));
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int r = 0; r < skipper; ++r) {
    threads.emplace_back([&, r] {
      try {
        all_reduce_on(r);
        errors[static_cast<size_t>(r)] = "no error";
      } catch (const Error& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(seconds, 2.5);   // nobody gave up before the timeout...
  EXPECT_LT(seconds, 20.0);  // ...and all within it, plus the aborts' grace
  const std::string named = str_cat("never issued it: ", skipper);
  for (int r = 0; r < skipper; ++r) {
    EXPECT_NE(errors[static_cast<size_t>(r)].find("all_reduce"), std::string::npos)
        << "rank " << r << ": " << errors[static_cast<size_t>(r)];
    EXPECT_NE(errors[static_cast<size_t>(r)].find(named), std::string::npos)
        << "rank " << r << ": " << errors[static_cast<size_t>(r)];
  }
  EXPECT_TRUE(test::raises([&] { comms[static_cast<size_t>(skipper)]->barrier(); },
                           {ErrorCode::kAborted}, {"barrier", "all_reduce", named}));
}

// The all_reduce is each communicator's first operation, so NCCL connects the ranks in it,
// which waits on the host for the skipping rank. With blocking communicators that wait was
// inside ncclAllReduce, before any timeout of ours: this test hung on 4 H200s (2026-11-26,
// issue 19). The communicators are now non-blocking (NcclOptions::nonblocking): NCCL does
// that work on its own thread, ncclAllReduce returns ncclInProgress, and the rank polls
// ncclCommGetAsyncError under the timeout, then aborts the group (ncclCommAbort stops the
// stuck connection).
TEST(NcclGroup, ARankThatSkipsACollectiveIsNamedWithinTheTimeout) {
  expect_skipped_all_reduce_named(/*connect_first=*/false);
}

// Connected ranks: the all_reduce is enqueued at once and its kernels wait on the GPUs for
// the skipping rank; the host wait on its end times out, and the abort ends the kernels.
TEST(NcclGroup, ARankThatSkipsACollectiveAfterOthersIsNamedWithinTheTimeout) {
  expect_skipped_all_reduce_named(/*connect_first=*/true);
}

}  // namespace
}  // namespace rd
