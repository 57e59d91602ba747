// Training checkpoint folders: round trips, atomic replacement, pruning to the newest K,
// clear errors (that spare the other checkpoints) for truncated or corrupted files, loading
// the weights alone, and the cleanup of what killed saves and deletions leave.
#include "ringdilated/train/checkpoint.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
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

// Sampling needs the weights only: a damaged optimizer file must not stop it.
TEST_F(CheckpointTest, LoadingTheWeightsNeitherReadsNorChecksTheOptimizer) {
  const std::string path = save_checkpoint(root_.string(), 4, contents(4), 3);
  flip_byte(fs::path(path) / "optimizer.safetensors", 9);
  const CheckpointContents weights = load_checkpoint(path, CheckpointParts::kWeights);
  EXPECT_TRUE(weights.optimizer.empty());
  ASSERT_EQ(weights.model.size(), contents(4).model.size());
  for (const auto& [name, t] : contents(4).model) {
    EXPECT_TRUE(allclose(t, weights.model.at(name), 0.0, 0.0)) << name;
  }
  EXPECT_NE(weights.trainer_state.find("\"step\": 4"), std::string::npos);
  // Resuming reads everything, and still refuses the damaged file.
  EXPECT_NE(error_of(path).find("optimizer.safetensors"), std::string::npos);
  // The weights themselves are still verified.
  flip_byte(fs::path(path) / "model.safetensors", 9);
  EXPECT_THROW(load_checkpoint(path, CheckpointParts::kWeights), Error);
}

// A process id that no longer runs: a child that has exited and been reaped.
pid_t dead_pid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  return child;
}

// A folder with a file in it, as a killed save or deletion leaves.
void make_leftover(const fs::path& folder) {
  fs::create_directories(folder);
  std::ofstream(folder / "model.safetensors") << "partial";
}

TEST_F(CheckpointTest, LeftoversOfDeadProcessesAreCleanedAndLiveOnesKept) {
  save_checkpoint(root_.string(), 1, contents(1), 3);
  const std::string dead = std::to_string(dead_pid());
  const std::string mine = std::to_string(::getpid());
  const std::vector<std::string> gone = {".tmp-step_000000004-" + dead + "-0",
                                         ".tmp-step_000000001-" + dead + "-1.old",
                                         ".trash-step_000000000-" + dead + "-2"};
  for (const std::string& name : gone) make_leftover(root_ / name);
  // This process's own temporaries may be a save in progress on another thread.
  const std::string kept = ".tmp-step_000000005-" + mine + "-7";
  make_leftover(root_ / kept);
  const std::vector<std::string> removed = clean_checkpoint_root(root_.string());
  EXPECT_EQ(removed, (std::vector<std::string>{gone[1], gone[0], gone[2]}));  // sorted
  for (const std::string& name : gone) EXPECT_FALSE(fs::exists(root_ / name)) << name;
  EXPECT_TRUE(fs::exists(root_ / kept));
  EXPECT_EQ(list_checkpoints(root_.string()).size(), 1u);
  EXPECT_TRUE(clean_checkpoint_root((root_ / "missing").string()).empty());
}

// Pruning also removes a dead save's temporary folder, and step folders without a manifest
// older than the new checkpoint (a deletion killed half-way by an older version); newer
// ones (a save that did not finish) are only listed, for the trainer's note.
TEST_F(CheckpointTest, PruningRemovesLeftoversAndHalfDeletedFolders) {
  make_leftover(root_ / (".tmp-step_000000003-" + std::to_string(dead_pid()) + "-0"));
  make_leftover(root_ / "step_000000002");
  make_leftover(root_ / "step_000000009");
  EXPECT_EQ(incomplete_checkpoints(root_.string()),
            (std::vector<std::string>{(root_ / "step_000000002").string(),
                                      (root_ / "step_000000009").string()}));
  EXPECT_EQ(incomplete_checkpoints(root_.string(), 2),
            std::vector<std::string>{(root_ / "step_000000009").string()});
  for (int64_t step : {4, 5, 6}) save_checkpoint(root_.string(), step, contents(step), 2);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(root_)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"step_000000005", "step_000000006", "step_000000009"}));
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
