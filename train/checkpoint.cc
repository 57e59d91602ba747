// Training checkpoint folders: atomic saves (temporary folder + rename), manifests with
// CRC-32 per file, verified loads, pruning to the newest K (rename to .trash-, then delete),
// and the cleanup of what killed saves and deletions leave.
#include "ringdilated/train/checkpoint.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <span>
#include <system_error>

#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/atomic_file.h"
#include "ringdilated/tensor/checksum.h"
#include "ringdilated/tensor/safetensors.h"

namespace rd::train {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr const char* kManifest = "manifest.json";
constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kTrainerFile = "trainer.json";
constexpr const char* kFormat = "ringdilated-checkpoint";
constexpr int kFormatVersion = 1;
constexpr const char* kStepPrefix = "step_";
constexpr const char* kTempPrefix = ".tmp-";     // a save being written
constexpr const char* kTrashPrefix = ".trash-";  // a checkpoint being deleted

std::span<const uint8_t> bytes_of(const std::string& text) {
  return {reinterpret_cast<const uint8_t*>(text.data()), text.size()};
}

Json digest_json(const FileDigest& d) { return {{"bytes", d.bytes}, {"crc32", d.crc32}}; }

FileDigest write_text(const std::string& path, const std::string& text) {
  AtomicFileWriter writer(path);
  writer.write(bytes_of(text));
  return writer.commit();
}

[[noreturn]] void corrupt(const std::string& path, const std::string& why) {
  RD_FAIL(kCorruptFile, "load_checkpoint: '", path, "' ", why,
          "; this checkpoint cannot be used (the others are untouched): resume from an older "
          "one with --resume=<folder>");
}

Json read_manifest(const std::string& folder) {
  const std::string path = (fs::path(folder) / kManifest).string();
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) {
    corrupt(folder, "has no manifest.json: it is not a checkpoint, or its save did not finish");
  }
  const std::vector<uint8_t> bytes = read_whole_file(path);
  Json manifest = Json::parse(bytes.begin(), bytes.end(), nullptr, /*allow_exceptions=*/false);
  if (manifest.is_discarded() || !manifest.is_object() || manifest.value("format", "") != kFormat ||
      !manifest.contains("step") || !manifest["step"].is_number_integer() ||
      !manifest.contains("files") || !manifest["files"].is_object()) {
    corrupt(path, "is not a valid checkpoint manifest");
  }
  if (manifest.value("version", 0) != kFormatVersion) {
    corrupt(path, "has format version " + manifest.value("version", Json(0)).dump() +
                      ", this build reads version " + std::to_string(kFormatVersion));
  }
  return manifest;
}

// Reads `name` from the checkpoint folder and checks it against the manifest's entry.
std::vector<uint8_t> read_verified(const std::string& folder, const Json& manifest,
                                   const std::string& name) {
  const std::string path = (fs::path(folder) / name).string();
  const Json& files = manifest["files"];
  if (!files.contains(name)) corrupt(folder, "has no " + name + " in its manifest");
  const Json& entry = files[name];
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) corrupt(path, "is missing");
  const std::vector<uint8_t> bytes = read_whole_file(path);
  const uint64_t want_bytes = entry.value("bytes", uint64_t{0});
  if (bytes.size() != want_bytes) {
    corrupt(path, "has " + std::to_string(bytes.size()) + " bytes, the manifest says " +
                      std::to_string(want_bytes) + " (truncated or overwritten)");
  }
  const uint32_t crc = crc32_update(0, bytes);
  const uint32_t want_crc = entry.value("crc32", uint32_t{0});
  if (crc != want_crc) {
    char text[64];
    std::snprintf(text, sizeof(text), "CRC-32 %08x, the manifest says %08x", crc, want_crc);
    corrupt(path, std::string("fails its checksum: ") + text);
  }
  return bytes;
}

std::map<std::string, Tensor> read_tensors(const std::string& folder, const Json& manifest,
                                           const std::string& name) {
  const std::vector<uint8_t> bytes = read_verified(folder, manifest, name);
  return parse_safetensors(bytes, (fs::path(folder) / name).string()).tensors;
}

// step_000000042 -> 42; nullopt for other names.
std::optional<int64_t> step_of_name(const std::string& name) {
  const std::string prefix = kStepPrefix;
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return {};
  int64_t step = 0;
  for (size_t i = prefix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || step > (INT64_MAX - 9) / 10) return {};
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

void remove_quietly(const fs::path& path) {
  std::error_code ec;
  fs::remove_all(path, ec);  // best effort: a leftover is ignored by list_checkpoints
}

// "-<pid>-<n>": distinct names for the temporary and trash folders of concurrent savers.
std::string unique_suffix() {
  static std::atomic<uint64_t> counter{0};
  return "-" + std::to_string(::getpid()) + "-" + std::to_string(counter.fetch_add(1));
}

// The process that made a leftover folder (.tmp-step_..-<pid>-<n>[.old] or
// .trash-step_..-<pid>-<n>); nullopt for other names.
std::optional<pid_t> leftover_pid(const std::string& name) {
  std::string rest;
  for (const char* prefix : {kTempPrefix, kTrashPrefix}) {
    if (name.rfind(prefix, 0) == 0) rest = name.substr(std::string(prefix).size());
  }
  if (rest.empty()) return {};
  if (rest.size() > 4 && rest.compare(rest.size() - 4, 4, ".old") == 0) rest.resize(rest.size() - 4);
  const size_t last = rest.rfind('-');
  if (last == std::string::npos || last == 0) return {};
  const size_t before = rest.rfind('-', last - 1);
  if (before == std::string::npos) return {};
  const std::string pid = rest.substr(before + 1, last - before - 1);
  if (pid.empty() || pid.size() > 9 || pid.find_first_not_of("0123456789") != std::string::npos) {
    return {};
  }
  return static_cast<pid_t>(std::stol(pid));
}

bool process_alive(pid_t pid) { return ::kill(pid, 0) == 0 || errno == EPERM; }

// Deletes a step folder so that it stops being a checkpoint before any of its files go: a
// rename to a .trash- name (atomic), then the removal, which a kill may interrupt (the next
// clean_checkpoint_root finishes it). Where the rename fails, the manifest goes first.
void retire(const fs::path& folder) {
  const fs::path trash =
      folder.parent_path() / (kTrashPrefix + folder.filename().string() + unique_suffix());
  std::error_code ec;
  fs::rename(folder, trash, ec);
  if (!ec) {
    remove_quietly(trash);
    return;
  }
  fs::remove(folder / kManifest, ec);
  remove_quietly(folder);
}

struct StepFolder {
  int64_t step;
  std::string path;
  bool complete;  // has a manifest
};

// Every step_* folder under `root`, by step.
std::vector<StepFolder> step_folders(const std::string& root) {
  std::vector<StepFolder> found;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return {};
  for (const fs::directory_entry& entry : fs::directory_iterator(root, ec)) {
    const std::optional<int64_t> step = step_of_name(entry.path().filename().string());
    if (!step || !entry.is_directory(ec)) continue;
    found.push_back({*step, entry.path().string(), fs::is_regular_file(entry.path() / kManifest, ec)});
  }
  std::sort(found.begin(), found.end(),
            [](const StepFolder& a, const StepFolder& b) { return a.step < b.step; });
  return found;
}

// After the save of `step`: keeps the newest `keep_last` checkpoints, deletes the older ones
// and the incomplete step folders older than `step`, and the leftovers of dead processes.
void prune(const std::string& root, int64_t step, int keep_last) {
  const std::vector<std::string> all = list_checkpoints(root);
  for (size_t i = 0; i + static_cast<size_t>(keep_last) < all.size(); ++i) retire(all[i]);
  for (const StepFolder& f : step_folders(root)) {
    if (!f.complete && f.step < step) retire(f.path);
  }
  clean_checkpoint_root(root);
}

}  // namespace

std::string checkpoint_path(const std::string& root, int64_t step) {
  RD_CHECK(step >= 0, kInvalidArgument, "checkpoint_path: step must be >= 0, got ", step);
  char name[32];
  std::snprintf(name, sizeof(name), "%s%09lld", kStepPrefix, static_cast<long long>(step));
  return (fs::path(root) / name).string();
}

std::string save_checkpoint(const std::string& root, int64_t step,
                            const CheckpointContents& contents, int keep_last) {
  RD_CHECK(keep_last >= 1, kInvalidArgument, "save_checkpoint: keep_last must be >= 1, got ",
           keep_last);
  RD_CHECK(!root.empty(), kInvalidArgument, "save_checkpoint: the checkpoint folder is empty");
  const Json trainer = Json::parse(contents.trainer_state, nullptr, false);
  RD_CHECK(!trainer.is_discarded(), kInvalidArgument,
           "save_checkpoint: trainer_state is not valid JSON");
  std::error_code ec;
  fs::create_directories(root, ec);
  RD_CHECK(!ec, kIo, "save_checkpoint: cannot create folder '", root, "': ", ec.message());

  const fs::path final_path = checkpoint_path(root, step);
  const fs::path temp =
      fs::path(root) / (kTempPrefix + final_path.filename().string() + unique_suffix());
  remove_quietly(temp);
  fs::create_directory(temp, ec);
  RD_CHECK(!ec, kIo, "save_checkpoint: cannot create folder '", temp.string(), "': ", ec.message());
  try {
    Json manifest = {{"format", kFormat}, {"version", kFormatVersion}, {"step", step}};
    manifest["files"][kModelFile] =
        digest_json(save_safetensors((temp / kModelFile).string(), contents.model));
    manifest["files"][kOptimizerFile] =
        digest_json(save_safetensors((temp / kOptimizerFile).string(), contents.optimizer));
    manifest["files"][kTrainerFile] =
        digest_json(write_text((temp / kTrainerFile).string(), trainer.dump(2) + "\n"));
    write_text((temp / kManifest).string(), manifest.dump(2) + "\n");
    // Replacing a checkpoint of the same step: move the old one aside first (rename cannot
    // replace a non-empty folder), and delete it only once the new one is in place.
    const fs::path old = temp.string() + ".old";
    const bool had_old = fs::exists(final_path, ec);
    if (had_old) fs::rename(final_path, old);
    fs::rename(temp, final_path);
    sync_folder(root);
    if (had_old) remove_quietly(old);
  } catch (const fs::filesystem_error& e) {
    remove_quietly(temp);
    RD_FAIL(kIo, "save_checkpoint: cannot write '", final_path.string(), "': ", e.what());
  } catch (...) {
    remove_quietly(temp);
    throw;
  }
  prune(root, step, keep_last);
  return final_path.string();
}

CheckpointContents load_checkpoint(const std::string& path, CheckpointParts parts) {
  const Json manifest = read_manifest(path);
  CheckpointContents c;
  c.model = read_tensors(path, manifest, kModelFile);
  if (parts == CheckpointParts::kAll) c.optimizer = read_tensors(path, manifest, kOptimizerFile);
  const std::vector<uint8_t> trainer = read_verified(path, manifest, kTrainerFile);
  c.trainer_state.assign(trainer.begin(), trainer.end());
  if (Json::parse(c.trainer_state, nullptr, false).is_discarded()) {
    corrupt((fs::path(path) / kTrainerFile).string(), "is not valid JSON");
  }
  return c;
}

int64_t checkpoint_step(const std::string& path) {
  return read_manifest(path)["step"].get<int64_t>();
}

std::vector<std::string> list_checkpoints(const std::string& root) {
  std::vector<std::string> paths;
  for (StepFolder& f : step_folders(root)) {
    if (f.complete) paths.push_back(std::move(f.path));
  }
  return paths;
}

std::optional<std::string> latest_checkpoint(const std::string& root) {
  std::vector<std::string> all = list_checkpoints(root);
  if (all.empty()) return std::nullopt;
  return all.back();
}

std::vector<std::string> incomplete_checkpoints(const std::string& root, int64_t after_step) {
  std::vector<std::string> paths;
  for (StepFolder& f : step_folders(root)) {
    if (!f.complete && f.step > after_step) paths.push_back(std::move(f.path));
  }
  return paths;
}

std::vector<std::string> clean_checkpoint_root(const std::string& root) {
  std::vector<std::string> removed;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return removed;
  std::vector<fs::path> leftovers;
  for (const fs::directory_entry& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    const std::optional<pid_t> pid = leftover_pid(name);
    if (pid && *pid != ::getpid() && !process_alive(*pid)) leftovers.push_back(entry.path());
  }
  for (const fs::path& path : leftovers) {  // not while iterating the folder
    remove_quietly(path);
    if (!fs::exists(path, ec)) removed.push_back(path.filename().string());
  }
  std::sort(removed.begin(), removed.end());
  return removed;
}

}  // namespace rd::train
