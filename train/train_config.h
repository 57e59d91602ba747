// The trainer's configuration (TrainConfig) and its one description: every field's saved
// JSON key, rd_train flag, help text and defaults, from which the checkpoint's JSON, the
// flags, --help and the resume check are all derived; and the one spelling of each enum.
#pragma once

#include <concepts>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "ringdilated/kernels/device.h"
#include "ringdilated/nn/lr_schedule.h"
#include "ringdilated/nn/ring_dilated_attention.h"
#include "ringdilated/train/dataset.h"
#include "ringdilated/train/model.h"

namespace rd::train {

// Each field is described once, in visit_config_fields below: a new field is its member
// here and one line there.
struct TrainConfig {
  ModelConfig model;
  std::string data = "passkey";  // make_dataset's spec
  DatasetOptions data_options;   // data_options.task.seq_len is the sequence length
  // Sequences per micro-batch on each data-parallel rank, and the target batch of one
  // optimizer step in tokens (over every rank): the gradient is accumulated over
  // tokens_per_step / (batch_size x seq_len x data-parallel ranks) micro-batches (at least 1).
  int64_t batch_size = 8;
  int64_t tokens_per_step = 0;  // 0: one micro-batch per step
  int64_t steps = 1000;

  // AdamW with decoupled weight decay (not on norms and embeddings), linear warmup then
  // decay, global gradient-norm clipping (0: off).
  double lr = 1e-3;
  double min_lr_ratio = 0.1;
  int64_t warmup_steps = 50;
  nn::LrDecay decay = nn::LrDecay::kCosine;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double grad_clip = 1.0;

  // Compute dtype: float32, bfloat16 or float16 (with dynamic loss scaling), or empty for
  // nn::recommended_dtype(device). Lower precision keeps float32 master weights.
  std::string dtype;
  Device device = Device::cpu();

  int64_t eval_every = 100;  // 0: only at the end
  // Stop training at the first periodic evaluation whose held-out exact match is at least
  // this (tasks with answers; 0: off): the run then ends as if its last step were reached
  // (final evaluation on final_eval_batches, checkpoint). How long the passkey task takes
  // depends on a sudden, run-dependent learning transition; stopping once it has happened
  // saves the steps after it. It may change on resume.
  double stop_at_exact_match = 0;
  int64_t eval_batches = 8;         // of batch_size held-out sequences
  int64_t final_eval_batches = 32;  // the evaluation at the end (the reported accuracy)
  int64_t log_every = 10;
  int64_t checkpoint_every = 0;  // 0: only at the end (and on a stop request)
  int keep_checkpoints = 3;
  std::string out_dir = "runs/default";  // checkpoints/, metrics.jsonl
  // Resume from the newest checkpoint in out_dir/checkpoints ("auto": if there is one),
  // or from this checkpoint folder.
  std::string resume;
  // Resuming refuses a configuration that changes what the run computes (the fields
  // described OnResume::kMustMatch, and the world size), naming each difference; true
  // resumes anyway, with a note. Logging, evaluation, checkpoint and memory settings, the
  // device and the sequence-parallel strategy may always change.
  bool allow_config_change = false;
  uint64_t seed = 0;

  // Ranks of a context-parallel group (the sequence is split among them); the others are
  // data parallel. Must divide the world size and the sequence length.
  int context_parallel = 1;
  nn::DistStrategy strategy = nn::DistStrategy::kAuto;
  // How the context-parallel ranks split each sequence (kAuto: zigzag, which balances the
  // causal work, when 2 x context_parallel divides the sequence length).
  nn::SequenceLayout cp_layout = nn::SequenceLayout::kAuto;
  bool quiet = false;  // no console output (tests)
};

// ---------------------------------------------------------------------------------------
// Enum names: the one spelling of each enum's values, for flags, saved configurations and
// messages. The sequence-parallel ones are nn's own (nn::strategy_name, nn::layout_name).

template <class E>
struct EnumName {
  E value;
  std::string_view name;
};

// Each enum's names; the argument only picks the table.
std::span<const EnumName<nn::LrDecay>> enum_names(nn::LrDecay);
std::span<const EnumName<nn::MLPActivation>> enum_names(nn::MLPActivation);
std::span<const EnumName<nn::DilationVariant>> enum_names(nn::DilationVariant);
std::span<const EnumName<nn::HeadMixing>> enum_names(nn::HeadMixing);
std::span<const EnumName<nn::OffsetRule>> enum_names(nn::OffsetRule);
std::span<const EnumName<nn::DistStrategy>> enum_names(nn::DistStrategy);
std::span<const EnumName<nn::SequenceLayout>> enum_names(nn::SequenceLayout);
std::span<const EnumName<LossOn>> enum_names(LossOn);

template <class E>
concept NamedEnum = std::is_enum_v<E> && requires(E e) {
  enum_names(e);
};

template <NamedEnum E>
std::string_view enum_name(E value) {
  for (const EnumName<E>& n : enum_names(E{})) {
    if (n.value == value) return n.name;
  }
  return "?";
}

template <NamedEnum E>
std::optional<E> enum_from_name(std::string_view name) {
  for (const EnumName<E>& n : enum_names(E{})) {
    if (n.name == name) return n.value;
  }
  return std::nullopt;
}

// "cosine, linear, constant": the names, for messages.
template <NamedEnum E>
std::string enum_choices() {
  std::string choices;
  for (const EnumName<E>& n : enum_names(E{})) {
    choices += (choices.empty() ? "" : ", ") + std::string(n.name);
  }
  return choices;
}

// ---------------------------------------------------------------------------------------
// The description.

// How resuming treats a field whose value differs from the checkpoint's.
enum class OnResume {
  kMustMatch,  // it changes what the run computes: refused without allow_config_change
  kMayChange,  // it changes how the run is logged, evaluated, saved or computed
};

// One field of TrainConfig. Values in text are written as on rd_train's command line
// ("128,256", "cosine", "0.002").
struct ConfigField {
  std::string_view section;  // of the saved JSON: "model", "data", "train" or "run"
  std::string_view key;      // within the section
  std::string_view help;     // rd_train --help
  std::string_view flag;     // rd_train's flag; empty: none (the trainer sets the field)
  // rd_train's default where it differs from TrainConfig's (a CPU run that learns the
  // passkey task in minutes; TrainConfig's suit tests and library callers).
  std::optional<std::string_view> cli_default;
  // What a saved configuration without the key (a checkpoint from before the field) held;
  // none: TrainConfig's default.
  std::optional<std::string_view> if_missing;
  OnResume on_resume = OnResume::kMustMatch;

  std::string name() const { return std::string(section) + "." + std::string(key); }

  // The modifiers of the description's lines.
  constexpr ConfigField with_flag(std::string_view name) const {
    ConfigField f = *this;
    f.flag = name;
    return f;
  }
  constexpr ConfigField without_flag() const { return with_flag({}); }
  constexpr ConfigField with_cli_default(std::string_view text) const {
    ConfigField f = *this;
    f.cli_default = text;
    return f;
  }
  constexpr ConfigField with_if_missing(std::string_view text) const {
    ConfigField f = *this;
    f.if_missing = text;
    return f;
  }
  constexpr ConfigField may_change() const {
    ConfigField f = *this;
    f.on_resume = OnResume::kMayChange;
    return f;
  }
};

// A field whose flag is named after its key.
constexpr ConfigField config_field(std::string_view section, std::string_view key,
                                   std::string_view help) {
  ConfigField field;
  field.section = section;
  field.key = key;
  field.help = help;
  field.flag = key;
  return field;
}

namespace config_description {

// The data fields (saved in section "data").
template <class Config, class Visitor>
void visit_data_fields(Config& c, Visitor& visit) {
  auto& task = c.data_options.task;
  const auto field = [](std::string_view key, std::string_view help) {
    return config_field("data", key, help);
  };
  visit(c.data, field("spec",
                      "passkey, mqar, copy (synthetic, generated on the fly), "
                      "text:<paths> (bytes of files) or tokens:<paths> (RDTOK token files); "
                      "<paths>: a file, a folder (its files in name order) or several, "
                      "comma-separated")
                    .with_flag("data"));
  visit(task.seq_len, field("seq_len", "tokens per sequence").with_cli_default("256"));
  visit(task.passkey_digits,
        field("passkey_digits", "digits of the passkey (chance is 10^-digits)"));
  visit(task.mqar_pairs, field("mqar_pairs", "key-value pairs of the mqar task"));
  visit(task.mqar_queries, field("mqar_queries", "queries of the mqar task"));
  visit(task.mqar_key_len, field("mqar_key_len", "letters of each key of the mqar task"));
  visit(task.mqar_value_len, field("mqar_value_len", "digits of each value of the mqar task"));
  visit(task.copy_length,
        field("copy_length", "length of the copy task's string; 0: as long as fits"));
  visit(c.data_options.seed,
        field("seed", "seed of the synthetic data and of text window shuffling")
            .with_flag("data_seed")
            .with_cli_default("1234"));
  visit(c.data_options.loss_on,
        field("loss_on", "synthetic tasks: train on 'answers' or 'all' tokens"));
  visit(c.data_options.val_fraction,
        field("val_fraction", "text and token files: the last fraction of the tokens held out"));
  visit(c.data_options.documents,
        field("documents",
              "text and token files: where packed documents start, attention staying within "
              "each: auto (each file, and each entry of an RDTOK file's table), off (no "
              "masks), separator:<text> (also after each occurrence; escapes \\n \\t \\xHH) "
              "or eos:<token id> (also after each such token)"));
}

// The model fields (section "model").
template <class Config, class Visitor>
void visit_model_fields(Config& c, Visitor& visit) {
  auto& attention = c.model.attention;
  const auto field = [](std::string_view key, std::string_view help) {
    return config_field("model", key, help);
  };
  visit(c.model.vocab_size,
        field("vocab_size", "tokens of the vocabulary (set from the data)").without_flag());
  visit(c.model.dim, field("dim", "model width").with_cli_default("64"));
  visit(c.model.depth, field("depth", "transformer blocks"));
  visit(c.model.heads, field("heads", "attention heads"));
  visit(c.model.kv_heads,
        field("kv_heads", "key/value heads (grouped-query attention), dividing heads; 0: heads"));
  visit(c.model.mlp_ratio,
        field("mlp_ratio", "MLP hidden width / model width (SwiGLU uses 2/3 of it)"));
  visit(c.model.mlp, field("mlp", "swiglu or gelu"));
  visit(attention.segment_lengths, field("segment_lengths",
                                         "segment lengths of the dilated attention pairs, comma "
                                         "separated")
                                       .with_flag("segments")
                                       .with_cli_default("128,256"));
  visit(attention.dilation_rates, field("dilation_rates", "dilation rates, one per segment length")
                                      .with_flag("dilations")
                                      .with_cli_default("1,2"));
  visit(attention.variant, field("variant", "fixed (segment-local) or original (global) dilation"));
  visit(attention.mixing,
        field("mixing", "head_groups or all_heads").with_cli_default("all_heads"));
  visit(attention.offset_rule, field("offset_rule",
                                     "offsets of the fixed variant: constant (the same in every "
                                     "segment) or rotating (with the segment index)"));
  visit(attention.dropout,
        field("attention_dropout", "dropout of the attention probabilities (training only)"));
  visit(c.model.rope_base, field("rope_base", "rotary position embedding base"));
  visit(c.model.init_std, field("init_std",
                                "standard deviation of the initial weights (that of the residual "
                                "projections is divided by sqrt(2 depth))"));
  visit(c.model.recompute,
        field("recompute", "recompute each block's activations in the backward").may_change());
  visit(c.model.mlp_chunk_tokens, field("mlp_chunk_tokens",
                                        "with --recompute: run the MLP over sequence chunks of at "
                                        "most this many tokens, each recomputed on its own (0: the "
                                        "whole sequence at once)")
                                      .with_cli_default("131072")
                                      .may_change());
}

// The optimization and parallelism fields (section "train").
template <class Config, class Visitor>
void visit_train_fields(Config& c, Visitor& visit) {
  const auto field = [](std::string_view key, std::string_view help) {
    return config_field("train", key, help);
  };
  visit(c.steps, field("steps", "optimizer steps (at most: see --stop_at_exact_match)")
                     .with_cli_default("6000"));
  visit(c.batch_size, field("batch_size", "sequences per micro-batch on each data-parallel rank")
                          .with_cli_default("4"));
  visit(c.tokens_per_step, field("tokens_per_step",
                                 "target batch in tokens over every rank (gradient "
                                 "accumulation); 0: one micro-batch"));
  visit(c.lr, field("lr", "peak learning rate").with_cli_default("0.002"));
  visit(c.min_lr_ratio, field("min_lr_ratio", "the decay's floor, as a fraction of the peak"));
  visit(c.warmup_steps, field("warmup_steps", "linear warmup steps").with_cli_default("100"));
  visit(c.decay, field("decay", "cosine, linear or constant"));
  visit(c.weight_decay, field("weight_decay", "AdamW weight decay (not on norms and embeddings)"));
  visit(c.beta1, field("beta1", "AdamW's decay of the gradient's running mean"));
  visit(c.beta2, field("beta2", "AdamW's decay of the squared gradient's running mean"));
  visit(c.grad_clip, field("grad_clip", "global gradient-norm clip; 0: off"));
  visit(c.dtype, field("dtype", "float32, bfloat16, float16; empty: the device's recommendation"));
  visit(c.seed,
        field("seed", "seed of the model's initialization and dropout (and of sample's draws)"));
  visit(c.context_parallel, field("context_parallel",
                                  "ranks per context-parallel group (the sequence is split "
                                  "among them); the rest of the world is data parallel"));
  visit(c.strategy,
        field("strategy", "sequence-parallel attention: ring, all_gather or auto").may_change());
  // Checkpoints from before the layout existed split contiguously.
  visit(c.cp_layout, field("cp_layout",
                           "how context-parallel ranks split a sequence: zigzag (rank r "
                           "holds pieces r and 2P-1-r of 2P, balancing the causal work), "
                           "contiguous, or auto (zigzag when 2P divides --seq_len)")
                         .with_if_missing("contiguous")
                         .may_change());
}

// The settings of the run itself (section "run"): how it is logged, evaluated and saved,
// free to change on resume.
template <class Config, class Visitor>
void visit_run_fields(Config& c, Visitor& visit) {
  const auto field = [](std::string_view key, std::string_view help) {
    return config_field("run", key, help).may_change();
  };
  visit(
      c.device,
      field("device", "auto (a GPU when there is one), cpu or cuda[:N]").with_cli_default("auto"));
  visit(c.eval_every, field("eval_every", "evaluate every N steps (and at the end)"));
  visit(c.eval_batches,
        field("eval_batches", "held-out batches (of --batch_size sequences) per evaluation")
            .with_cli_default("16"));
  visit(c.stop_at_exact_match, field("stop_at_exact_match",
                                     "stop training at the first evaluation (every "
                                     "--eval_every steps) whose held-out exact match is at least "
                                     "this, then run the final evaluation; tasks only (text has "
                                     "no exact match); 0: train all --steps")
                                   .with_cli_default("0.98"));
  visit(c.final_eval_batches,
        field("final_eval_batches", "held-out batches of the final evaluation")
            .with_cli_default("64"));
  visit(c.log_every, field("log_every", "progress line and metrics record every N steps"));
  visit(c.checkpoint_every,
        field("checkpoint_every", "checkpoint every N steps (and at the end); 0: end only")
            .with_cli_default("500"));
  visit(c.keep_checkpoints, field("keep_checkpoints", "checkpoints to keep"));
  visit(
      c.out_dir,
      field("out_dir", "run folder: checkpoints/, metrics.jsonl").with_cli_default("runs/passkey"));
  visit(c.resume, field("resume",
                        "auto (the newest checkpoint in out_dir if any), latest (it must "
                        "exist), a checkpoint folder, or empty to start over")
                      .with_cli_default("auto"));
  visit(c.allow_config_change, field("allow_config_change",
                                     "resume even though data, model or optimization flags "
                                     "differ from the checkpoint's (without it such a resume is "
                                     "refused, listing each difference)"));
  visit(c.quiet, field("quiet", "no progress lines or notes (the final result is still printed)"));
}

}  // namespace config_description

// Calls visit(member, field) for every field of `c` (a TrainConfig, const or not), in the
// order of rd_train's documentation. The attention options not listed are the model's
// (causal) or the kernels' choices (scale, Hilbert order, path), left at their defaults.
template <class Config, class Visitor>
requires std::same_as<std::remove_const_t<Config>, TrainConfig>
void visit_config_fields(Config& c, Visitor&& visit) {
  config_description::visit_data_fields(c, visit);
  config_description::visit_model_fields(c, visit);
  config_description::visit_train_fields(c, visit);
  config_description::visit_run_fields(c, visit);
}

// The description's fields, in order.
std::vector<ConfigField> config_fields();
// The field whose flag is `flag`; nullopt if none.
std::optional<ConfigField> config_field_of_flag(std::string_view flag);

// The value of `field` in `config` as text ("128,256", "cosine", "0.002").
std::string config_field_text(const TrainConfig& config, const ConfigField& field);
// Sets `field` of `config` from text; a value that does not parse throws rd::Error
// (kInvalidArgument) saying what `what` (e.g. "--mlp") must be, with the allowed values.
void set_config_field(TrainConfig& config, const ConfigField& field, std::string_view text,
                      std::string_view what);
// rd_train's default of the field, as text.
std::string cli_default_text(const ConfigField& field);

// The configuration as JSON text (stored in every checkpoint's trainer.json: an object per
// section, a key per field) and back. Keys a saved configuration lacks take the field's
// if_missing value or default; a value of the wrong type or an unknown name is an
// rd::Error (kCorruptFile) naming the field and what it must be.
std::string config_to_json(const TrainConfig& config);
TrainConfig config_from_json(const std::string& json);
// The configuration a checkpoint's trainer state (CheckpointContents::trainer_state) holds.
TrainConfig config_from_checkpoint(const std::string& trainer_state);

// "section.key: saved X, now Y" (values in JSON) for each OnResume::kMustMatch field that
// differs; `steps` only where the learning rates differ (a constant decay after the same
// warmup gives every step the same rate whatever the steps).
std::vector<std::string> config_changes(const TrainConfig& saved, const TrainConfig& now);

}  // namespace rd::train
