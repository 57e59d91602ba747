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
// newest `keep_last` checkpoints (>= 1) are kept; older ones are deleted.
std::string save_checkpoint(const std::string& root, int64_t step,
                            const CheckpointContents& contents, int keep_last);

// Reads the checkpoint folder `path` and checks every file against the manifest first: a
// missing manifest or file, a size or a CRC-32 that differs, or a file that does not parse
// throws rd::Error(kCorruptFile) naming the file. Other checkpoints are never touched.
CheckpointContents load_checkpoint(const std::string& path);

// The step a checkpoint folder holds, from its manifest (checked as load_checkpoint does
// for the manifest alone).
int64_t checkpoint_step(const std::string& path);

// The complete checkpoints under `root` (folders step_* with a manifest), oldest first. A
// missing root has none. Temporary folders of interrupted saves are ignored.
std::vector<std::string> list_checkpoints(const std::string& root);

// The newest complete checkpoint under `root`, if any.
std::optional<std::string> latest_checkpoint(const std::string& root);

}  // namespace rd::train
