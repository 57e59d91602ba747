// Training checkpoint folders: round trips, atomic replacement, pruning to the newest K,
// and clear errors (that spare the other checkpoints) for truncated or corrupted files.
#include "ringdilated/train/checkpoint.h"

#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "gtest/gtest.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/ops.h"
#include "ringdilated/tensor/tensor.h"
#include "testing/temp_dir.h"

namespace rd::train {
namespace {

namespace fs = std::filesystem;

class CheckpointTest : public ::testing::Test {
 protected:
  // Random non-zero contents that differ per step.
  static CheckpointContents contents(int64_t step) {
    Generator gen(static_cast<uint64_t>(step) + 1);
    CheckpointContents c;
    c.model["embed.weight"] = randn({7, 5}, gen);
    c.model["blocks.0.norm.weight"] = randn({5}, gen, DType::kFloat64);
    c.optimizer["exp_avg.embed.weight"] = randn({7, 5}, gen);
    c.optimizer["step"] = full({}, static_cast<double>(step), DType::kInt64);
    c.trainer_state = "{\"step\": " + std::to_string(step) + ", \"data\": [1, 2, 3]}";
    return c;
  }

  static void expect_same(const CheckpointContents& a, const CheckpointContents& b) {
    ASSERT_EQ(a.model.size(), b.model.size());
    for (const auto& [name, t] : a.model) EXPECT_TRUE(allclose(t, b.model.at(name), 0.0, 0.0)) << name;
    ASSERT_EQ(a.optimizer.size(), b.optimizer.size());
    for (const auto& [name, t] : a.optimizer) EXPECT_TRUE(allclose(t, b.optimizer.at(name), 0.0, 0.0)) << name;
  }

  static void flip_byte(const fs::path& file, std::streamoff at) {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(at);
    char c = 0;
    f.read(&c, 1);
    f.seekp(at);
    c = static_cast<char>(c ^ 0x40);
    f.write(&c, 1);
  }

  static std::string error_of(const std::string& path) {
    try {
      load_checkpoint(path);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kCorruptFile) << e.what();
      return e.what();
    }
    ADD_FAILURE() << "load_checkpoint(" << path << ") did not throw";
    return "";
  }

  test::TestTempDir temp_;
  fs::path root_ = temp_.path() / "checkpoints";
};

TEST_F(CheckpointTest, RoundTripsBitExactly) {
  const CheckpointContents c = contents(12);
  const std::string path = save_checkpoint(root_.string(), 12, c, 3);
  EXPECT_EQ(path, checkpoint_path(root_.string(), 12));
  EXPECT_EQ(fs::path(path).filename(), "step_000000012");
  EXPECT_EQ(checkpoint_step(path), 12);
  const CheckpointContents back = load_checkpoint(path);
  expect_same(c, back);
  EXPECT_NE(back.trainer_state.find("\"step\": 12"), std::string::npos) << back.trainer_state;
  // Only the checkpoint folder: no temporaries left behind.
  int entries = 0;
  for (const auto& e : fs::directory_iterator(root_)) entries += e.is_directory() ? 1 : 100;
  EXPECT_EQ(entries, 1);
}

TEST_F(CheckpointTest, KeepsTheNewestKAndListsThemInOrder) {
  for (int64_t step : {5, 10, 15, 20}) save_checkpoint(root_.string(), step, contents(step), 2);
  const std::vector<std::string> all = list_checkpoints(root_.string());
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(checkpoint_step(all[0]), 15);
  EXPECT_EQ(checkpoint_step(all[1]), 20);
  EXPECT_EQ(latest_checkpoint(root_.string()), all[1]);
  EXPECT_FALSE(latest_checkpoint((root_ / "none").string()).has_value());
}

TEST_F(CheckpointTest, ReplacingAStepKeepsOneCompleteCopy) {
  save_checkpoint(root_.string(), 7, contents(1), 3);
  const std::string path = save_checkpoint(root_.string(), 7, contents(2), 3);
  expect_same(contents(2), load_checkpoint(path));
  EXPECT_EQ(list_checkpoints(root_.string()).size(), 1u);
}

TEST_F(CheckpointTest, AnInterruptedSaveIsNotACheckpoint) {
  save_checkpoint(root_.string(), 3, contents(3), 3);
  // A save that died before its rename leaves a temporary folder; one that died inside a
  // step folder (impossible through save_checkpoint, but by hand) has no manifest.
  fs::create_directories(root_ / ".tmp-step_000000004-1-0");
  fs::create_directories(root_ / "step_000000009");
  EXPECT_EQ(latest_checkpoint(root_.string()), checkpoint_path(root_.string(), 3));
  EXPECT_NE(error_of((root_ / "step_000000009").string()).find("manifest"), std::string::npos);
}

TEST_F(CheckpointTest, CorruptedOrTruncatedFilesAreClearErrorsAndSpareTheOthers) {
  const std::string older = save_checkpoint(root_.string(), 1, contents(1), 5);
  for (const char* file : {"model.safetensors", "optimizer.safetensors", "trainer.json"}) {
    SCOPED_TRACE(file);
    const std::string path = save_checkpoint(root_.string(), 2, contents(2), 5);
    flip_byte(fs::path(path) / file, 9);
    std::string what = error_of(path);
    EXPECT_NE(what.find(file), std::string::npos) << what;
    EXPECT_NE(what.find("checksum"), std::string::npos) << what;

    fs::resize_file(fs::path(path) / file, 5);
    what = error_of(path);
    EXPECT_NE(what.find("truncated"), std::string::npos) << what;

    fs::remove(fs::path(path) / file);
    what = error_of(path);
    EXPECT_NE(what.find("missing"), std::string::npos) << what;
    expect_same(contents(1), load_checkpoint(older));  // untouched
  }
}

TEST_F(CheckpointTest, BadArgumentsAreClearErrors) {
  EXPECT_THROW(save_checkpoint(root_.string(), 1, contents(1), 0), Error);
  CheckpointContents bad = contents(1);
  bad.trainer_state = "{not json";
  EXPECT_THROW(save_checkpoint(root_.string(), 1, bad, 1), Error);
  EXPECT_FALSE(latest_checkpoint(root_.string()).has_value()) << "nothing half-written";
  EXPECT_THROW(checkpoint_path(root_.string(), -1), Error);
}

}  // namespace
}  // namespace rd::train
