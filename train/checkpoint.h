// Training checkpoints: one folder per save (model weights, optimizer state, trainer state),
// written whole or not at all, verified by checksums when read, the last K kept.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "ringdilated/tensor/tensor.h"

namespace rd::train {

// What one checkpoint holds. The tensors go to safetensors files (model.safetensors loads in
// PyTorch with the safetensors package); `trainer_state` is JSON text (step, RNG and data
// positions, the run's configuration) saved as trainer.json.
struct CheckpointContents {
  std::map<std::string, Tensor> model;
  std::map<std::string, Tensor> optimizer;
  std::string trainer_state = "{}";
};

// The folder of the checkpoint of `step` under `root`: root/step_<step, 9 digits>.
std::string checkpoint_path(const std::string& root, int64_t step);

// Writes the checkpoint of `step` under `root` (created if missing) and returns its folder.
// The files are written into a temporary folder beside it, each streamed tensor by tensor
// and fsynced, then manifest.json (sizes and CRC-32 of every file) last; the folder is
// then renamed into place and `root` fsynced, so a crash leaves either no checkpoint of
// `step` or a complete one. An existing checkpoint of `step` is replaced. Afterwards only the
// newest `keep_last` checkpoints (>= 1) are kept: older ones, and step folders older than
// `step` that lack a manifest, are deleted, each first renamed to a .trash- folder so that it
// stops being a checkpoint before its files go; leftovers of dead processes' saves and
// deletions are removed too (clean_checkpoint_root).
std::string save_checkpoint(const std::string& root, int64_t step,
                            const CheckpointContents& contents, int keep_last);

// Which files load_checkpoint reads: everything (resuming a run), or the weights and the
// trainer state only (sampling, which has no use for the optimizer state and should not fail
// on a damaged one).
enum class CheckpointParts { kAll, kWeights };

// Reads the checkpoint folder `path` and checks each file it reads against the manifest
// first: a missing manifest or file, a size or a CRC-32 that differs, or a file that does not
// parse throws rd::Error(kCorruptFile) naming the file. Other checkpoints are never touched.
// With CheckpointParts::kWeights the optimizer file is neither read nor checked, and the
// result's optimizer map is empty.
CheckpointContents load_checkpoint(const std::string& path,
                                   CheckpointParts parts = CheckpointParts::kAll);

// The step a checkpoint folder holds, from its manifest (checked as load_checkpoint does
// for the manifest alone).
int64_t checkpoint_step(const std::string& path);

// The complete checkpoints under `root` (folders step_* with a manifest), oldest first. A
// missing root has none. Temporary folders of interrupted saves are ignored.
std::vector<std::string> list_checkpoints(const std::string& root);

// The newest complete checkpoint under `root`, if any.
std::optional<std::string> latest_checkpoint(const std::string& root);

// The step_* folders under `root` without a manifest whose step is above `after_step`, oldest
// first: saves or deletions that did not finish (or folders made by hand). They are not
// checkpoints; a resumed run says which ones it skipped.
std::vector<std::string> incomplete_checkpoints(const std::string& root, int64_t after_step = -1);

// Removes what killed saves and deletions leave under `root`: the temporary folders of saves
// (.tmp-step_*) and the folders being deleted (.trash-step_*) of processes that no longer run
// on this machine (their names carry the process id); those of this process and of live ones
// are left alone. Returns the names removed.
std::vector<std::string> clean_checkpoint_root(const std::string& root);

}  // namespace rd::train
