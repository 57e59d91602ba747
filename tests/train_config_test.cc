// The trainer's configuration description (train/train_config.h): every field round-trips
// through the saved JSON, has a JSON key and (but the vocabulary) a flag whose default
// parses; old saved configurations load; bad values name the field and the allowed ones;
// the resume check follows the description; each enum's names round-trip.
#include "ringdilated/train/train_config.h"

#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <type_traits>

#include "gtest/gtest.h"
#include "ringdilated/kernels/error.h"

namespace rd::train {
namespace {

using Json = nlohmann::json;

// A value of the same type other than `v`.
template <class T>
T other_than(const T& v) {
  if constexpr (std::is_same_v<T, bool>) {
    return !v;
  } else if constexpr (std::is_integral_v<T>) {
    return v + 3;
  } else if constexpr (std::is_floating_point_v<T>) {
    return v * 1.5 + 0.25;
  } else if constexpr (NamedEnum<T>) {
    const auto names = enum_names(T{});
    for (size_t i = 0; i < names.size(); ++i) {
      if (names[i].value == v) return names[(i + 1) % names.size()].value;
    }
    return names.front().value;
  } else if constexpr (std::is_same_v<T, std::string>) {
    return v + "x";
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    T more = v;
    more.push_back(7);
    return more;
  } else {
    static_assert(std::is_same_v<T, Device>);
    return Device::cuda(v.is_cuda() ? v.index + 1 : 1);
  }
}

// Every field changed from its default.
TrainConfig every_field_changed() {
  TrainConfig c;
  visit_config_fields(c, [](auto& value, const ConfigField&) { value = other_than(value); });
  return c;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(TrainConfigDescriptionTest, EveryFieldRoundTripsThroughTheSavedJson) {
  const TrainConfig defaults;
  const TrainConfig changed = every_field_changed();
  const TrainConfig back = config_from_json(config_to_json(changed));
  for (const ConfigField& f : config_fields()) {
    EXPECT_NE(config_field_text(changed, f), config_field_text(defaults, f)) << f.name();
    EXPECT_EQ(config_field_text(back, f), config_field_text(changed, f)) << f.name();
  }
  EXPECT_EQ(config_to_json(back), config_to_json(changed));
  // The fields that drifted before: each one by name.
  EXPECT_EQ(back.model.mlp_chunk_tokens, changed.model.mlp_chunk_tokens);
  EXPECT_EQ(back.model.attention.offset_rule, nn::OffsetRule::kRotating);
}

TEST(TrainConfigDescriptionTest, EveryFieldHasAJsonKeyAndAFlagWhoseDefaultParses) {
  const Json saved = Json::parse(config_to_json(TrainConfig{}));
  std::set<std::string> names, flags;
  size_t keys = 0;
  for (const auto& [section, fields] : saved.items()) keys += fields.size();
  for (const ConfigField& f : config_fields()) {
    EXPECT_TRUE(names.insert(f.name()).second) << f.name() << " is described twice";
    ASSERT_TRUE(saved.contains(std::string(f.section))) << f.name();
    EXPECT_TRUE(saved[std::string(f.section)].contains(std::string(f.key))) << f.name();
    EXPECT_FALSE(f.help.empty()) << f.name();
    if (f.name() == "model.vocab_size") {  // the trainer sets it from the data
      EXPECT_TRUE(f.flag.empty());
      continue;
    }
    ASSERT_FALSE(f.flag.empty()) << f.name() << " has no flag";
    EXPECT_TRUE(flags.insert(std::string(f.flag)).second) << "--" << f.flag << " twice";
    const std::optional<ConfigField> by_flag = config_field_of_flag(f.flag);
    ASSERT_TRUE(by_flag.has_value()) << f.flag;
    EXPECT_EQ(by_flag->name(), f.name());
    TrainConfig c;
    EXPECT_NO_THROW(set_config_field(c, f, cli_default_text(f), f.flag)) << f.name();
  }
  EXPECT_EQ(keys, names.size()) << "the saved JSON has keys the description lacks";
  // The flags of the fields that had none, and rd_train's defaults that differ.
  for (const char* flag : {"offset_rule", "attention_dropout", "init_std", "beta1", "beta2",
                           "copy_length", "val_fraction", "mlp_chunk_tokens"}) {
    EXPECT_TRUE(flags.count(flag)) << flag;
  }
  EXPECT_EQ(cli_default_text(*config_field_of_flag("mlp_chunk_tokens")), "131072");
  EXPECT_EQ(cli_default_text(*config_field_of_flag("segments")), "128,256");
  EXPECT_EQ(cli_default_text(*config_field_of_flag("decay")), "cosine");
}

// A configuration as checkpoints before the description saved it: no run section, no
// mlp_chunk_tokens, mqar key and value lengths or cp_layout.
constexpr const char* kOldConfig = R"({
  "model": {"vocab_size": 259, "dim": 32, "depth": 2, "heads": 4, "mlp_ratio": 4.0,
            "mlp": "gelu", "segment_lengths": [16, 64], "dilation_rates": [1, 2],
            "variant": "fixed", "mixing": "all_heads", "offset_rule": "rotating",
            "attention_dropout": 0.1, "rope_base": 10000.0, "init_std": 0.02,
            "recompute": true},
  "data": {"spec": "copy", "seq_len": 64, "passkey_digits": 5, "mqar_pairs": 32,
           "mqar_queries": 8, "copy_length": 0, "seed": 5, "loss_on": "all",
           "val_fraction": 0.05},
  "train": {"batch_size": 4, "tokens_per_step": 0, "steps": 6, "lr": 0.002,
            "min_lr_ratio": 0.1, "warmup_steps": 2, "decay": "linear", "weight_decay": 0.1,
            "beta1": 0.9, "beta2": 0.95, "grad_clip": 1.0, "dtype": "", "seed": 11,
            "context_parallel": 2, "strategy": "ring"}})";

TEST(TrainConfigDescriptionTest, AnOldConfigurationLoadsWithTheDefaultsOfNewFields) {
  const TrainConfig c = config_from_json(kOldConfig);
  const TrainConfig defaults;
  EXPECT_EQ(c.model.mlp_chunk_tokens, defaults.model.mlp_chunk_tokens);
  EXPECT_EQ(c.data_options.task.mqar_key_len, defaults.data_options.task.mqar_key_len);
  EXPECT_EQ(c.eval_every, defaults.eval_every);
  EXPECT_EQ(c.device, defaults.device);
  // Checkpoints from before the layout existed split contiguously (not the default, auto).
  EXPECT_EQ(c.cp_layout, nn::SequenceLayout::kContiguous);
  // What they did save.
  EXPECT_EQ(c.model.dim, 32);
  EXPECT_EQ(c.model.mlp, nn::MLPActivation::kGelu);
  EXPECT_EQ(c.model.attention.offset_rule, nn::OffsetRule::kRotating);
  EXPECT_TRUE(c.model.recompute);
  EXPECT_EQ(c.data, "copy");
  EXPECT_EQ(c.data_options.loss_on, LossOn::kAll);
  EXPECT_EQ(c.decay, nn::LrDecay::kLinear);
  EXPECT_EQ(c.strategy, nn::DistStrategy::kRing);
  EXPECT_EQ(c.seed, 11u);
  EXPECT_EQ(c.model.attention.segment_lengths, (std::vector<int64_t>{16, 64}));
}

TEST(TrainConfigDescriptionTest, BadValuesNameTheFieldAndWhatItMayBe) {
  Json j = Json::parse(kOldConfig);
  j["model"]["mlp"] = "relu";
  std::string what = error_of([&] { config_from_json(j.dump()); });
  EXPECT_TRUE(has(what, "model.mlp must be one of swiglu, gelu, got 'relu'")) << what;
  j = Json::parse(kOldConfig);
  j["train"]["cp_layout"] = "spiral";
  what = error_of([&] { config_from_json(j.dump()); });
  EXPECT_TRUE(has(what, "train.cp_layout must be one of zigzag, contiguous, auto, got 'spiral'"))
      << what;
  j = Json::parse(kOldConfig);
  j["model"]["dim"] = "wide";
  what = error_of([&] { config_from_json(j.dump()); });
  EXPECT_TRUE(has(what, "model.dim must be an integer, got \"wide\"")) << what;
  try {
    config_from_json(j.dump());
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kCorruptFile);
  }

  TrainConfig c;
  what =
      error_of([&] { set_config_field(c, *config_field_of_flag("decay"), "sideways", "--decay"); });
  EXPECT_EQ(what, "--decay must be one of cosine, linear, constant, got 'sideways'");
  what = error_of(
      [&] { set_config_field(c, *config_field_of_flag("segments"), "16,x", "--segments"); });
  EXPECT_EQ(what, "--segments has 'x', not an integer");
  what = error_of([&] { set_config_field(c, *config_field_of_flag("device"), "gpu", "--device"); });
  EXPECT_EQ(what, "--device must be auto, cpu or cuda[:N], got 'gpu'");
  set_config_field(c, *config_field_of_flag("offset_rule"), "rotating", "--offset_rule");
  EXPECT_EQ(c.model.attention.offset_rule, nn::OffsetRule::kRotating);
}

// The resume check compares the fields described kMustMatch, in JSON, naming each.
TEST(TrainConfigDescriptionTest, ResumeChangesFollowTheDescription) {
  const TrainConfig saved = config_from_json(kOldConfig);
  EXPECT_TRUE(config_changes(saved, saved).empty());
  const std::vector<std::string> changes = config_changes(TrainConfig{}, every_field_changed());
  std::set<std::string> named;
  for (const std::string& change : changes) named.insert(change.substr(0, change.find(':')));
  for (const ConfigField& f : config_fields()) {
    EXPECT_EQ(named.count(f.name()), f.on_resume == OnResume::kMustMatch ? 1u : 0u) << f.name();
  }
  TrainConfig memory = saved;  // how the run computes, not what
  memory.model.mlp_chunk_tokens = 128;
  memory.strategy = nn::DistStrategy::kAllGather;
  memory.log_every = 1;
  EXPECT_TRUE(config_changes(saved, memory).empty());
  TrainConfig rule = saved;
  rule.model.attention.offset_rule = nn::OffsetRule::kConstant;
  EXPECT_EQ(config_changes(saved, rule),
            std::vector<std::string>{"model.offset_rule: saved \"rotating\", now \"constant\""});
  TrainConfig constant = saved;  // a constant rate after the same warmup: more steps are fine
  constant.decay = nn::LrDecay::kConstant;
  TrainConfig longer = constant;
  longer.steps = 60;
  EXPECT_TRUE(config_changes(constant, longer).empty());
}

template <class E>
void expect_names_round_trip() {
  std::set<std::string_view> seen;
  for (const EnumName<E>& n : enum_names(E{})) {
    EXPECT_TRUE(seen.insert(n.name).second) << n.name;
    EXPECT_EQ(enum_name(n.value), n.name);
    EXPECT_EQ(enum_from_name<E>(n.name), n.value) << n.name;
  }
  EXPECT_FALSE(enum_from_name<E>("no such name").has_value());
}

TEST(TrainConfigDescriptionTest, EachEnumsNamesRoundTrip) {
  expect_names_round_trip<nn::LrDecay>();
  expect_names_round_trip<nn::MLPActivation>();
  expect_names_round_trip<nn::DilationVariant>();
  expect_names_round_trip<nn::HeadMixing>();
  expect_names_round_trip<nn::OffsetRule>();
  expect_names_round_trip<nn::DistStrategy>();
  expect_names_round_trip<nn::SequenceLayout>();
  expect_names_round_trip<LossOn>();
  EXPECT_EQ(enum_choices<nn::DistStrategy>(), "ring, all_gather, auto");
  EXPECT_EQ(enum_name(nn::SequenceLayout::kZigzag), nn::layout_name(nn::SequenceLayout::kZigzag));
}

}  // namespace
}  // namespace rd::train
