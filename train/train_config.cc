// The trainer's configuration: the enums' names, each field type's text and JSON forms, and
// what visit_config_fields' description drives: the saved JSON, flag text and resume check.
#include "ringdilated/train/train_config.h"

#include <algorithm>
#include <charconv>
#include <nlohmann/json.hpp>
#include <utility>

#include "ringdilated/kernels/error.h"
#include "ringdilated/kernels/number_text.h"
#include "ringdilated/tensor/device.h"

namespace rd::train {

// ---------------------------------------------------------------------------------------
// Enum names.

std::span<const EnumName<nn::LrDecay>> enum_names(nn::LrDecay) {
  static constexpr EnumName<nn::LrDecay> kNames[] = {{nn::LrDecay::kCosine, "cosine"},
                                                     {nn::LrDecay::kLinear, "linear"},
                                                     {nn::LrDecay::kConstant, "constant"}};
  return kNames;
}

std::span<const EnumName<nn::MLPActivation>> enum_names(nn::MLPActivation) {
  static constexpr EnumName<nn::MLPActivation> kNames[] = {{nn::MLPActivation::kSwiGLU, "swiglu"},
                                                           {nn::MLPActivation::kGelu, "gelu"}};
  return kNames;
}

std::span<const EnumName<nn::DilationVariant>> enum_names(nn::DilationVariant) {
  static constexpr EnumName<nn::DilationVariant> kNames[] = {
      {nn::DilationVariant::kSegmentLocal, "fixed"}, {nn::DilationVariant::kGlobal, "original"}};
  return kNames;
}

std::span<const EnumName<nn::HeadMixing>> enum_names(nn::HeadMixing) {
  static constexpr EnumName<nn::HeadMixing> kNames[] = {
      {nn::HeadMixing::kHeadGroups, "head_groups"}, {nn::HeadMixing::kAllHeads, "all_heads"}};
  return kNames;
}

std::span<const EnumName<nn::OffsetRule>> enum_names(nn::OffsetRule) {
  static constexpr EnumName<nn::OffsetRule> kNames[] = {{nn::OffsetRule::kConstant, "constant"},
                                                        {nn::OffsetRule::kRotating, "rotating"}};
  return kNames;
}

std::span<const EnumName<nn::DistStrategy>> enum_names(nn::DistStrategy) {
  static const EnumName<nn::DistStrategy> kNames[] = {
      {nn::DistStrategy::kRing, nn::strategy_name(nn::DistStrategy::kRing)},
      {nn::DistStrategy::kAllGather, nn::strategy_name(nn::DistStrategy::kAllGather)},
      {nn::DistStrategy::kAuto, nn::strategy_name(nn::DistStrategy::kAuto)}};
  return kNames;
}

std::span<const EnumName<nn::SequenceLayout>> enum_names(nn::SequenceLayout) {
  static const EnumName<nn::SequenceLayout> kNames[] = {
      {nn::SequenceLayout::kZigzag, nn::layout_name(nn::SequenceLayout::kZigzag)},
      {nn::SequenceLayout::kContiguous, nn::layout_name(nn::SequenceLayout::kContiguous)},
      {nn::SequenceLayout::kAuto, nn::layout_name(nn::SequenceLayout::kAuto)}};
  return kNames;
}

std::span<const EnumName<LossOn>> enum_names(LossOn) {
  static constexpr EnumName<LossOn> kNames[] = {{LossOn::kAnswers, "answers"},
                                                {LossOn::kAll, "all"}};
  return kNames;
}

namespace {

using Json = nlohmann::json;

constexpr const char* kOp = "Trainer";

template <class T>
constexpr bool kUnsupported = false;

// ---------------------------------------------------------------------------------------
// The forms of a field's value: text as on the command line, and JSON.

// What a value of type T must look like, for messages.
template <class T>
std::string expected_form() {
  if constexpr (std::is_same_v<T, bool>) {
    return "true or false";
  } else if constexpr (std::is_unsigned_v<T>) {
    return "a non-negative integer";
  } else if constexpr (std::is_integral_v<T>) {
    return "an integer";
  } else if constexpr (std::is_floating_point_v<T>) {
    return "a number";
  } else if constexpr (NamedEnum<T>) {
    return "one of " + enum_choices<T>();
  } else if constexpr (std::is_same_v<T, std::string>) {
    return "a string";
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    return "a list of integers";
  } else if constexpr (std::is_same_v<T, Device>) {
    return "auto, cpu or cuda[:N]";
  } else {
    static_assert(kUnsupported<T>, "a configuration field of a type without a text form");
  }
}

[[noreturn]] void fail_value(ErrorCode code, std::string_view what, const std::string& expected,
                             std::string_view got) {
  throw Error(code, str_cat(what, " must be ", expected, ", got ", got));
}

std::string quoted(std::string_view text) { return str_cat("'", text, "'"); }

// "auto" resolves to the first GPU when there is one. Whether an index is visible is the
// trainer's check (check_train_config), so that saved configurations load anywhere.
std::optional<Device> device_from_text(std::string_view text) {
  if (text == "auto") return cuda_available() ? Device::cuda(0) : Device::cpu();
  if (text == "cpu") return Device::cpu();
  if (text == "cuda") return Device::cuda(0);
  if (!text.starts_with("cuda:") || text.size() > 9) return std::nullopt;
  const std::optional<int> index = number_from_text<int>(text.substr(5));
  if (!index || *index < 0) return std::nullopt;
  return Device::cuda(*index);
}

template <class T>
std::string to_text(const T& value) {
  if constexpr (std::is_same_v<T, bool>) {
    return value ? "true" : "false";
  } else if constexpr (std::is_integral_v<T>) {
    return std::to_string(value);
  } else if constexpr (std::is_floating_point_v<T>) {
    char buffer[64];
    const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);  // shortest
    return std::string(buffer, result.ptr);
  } else if constexpr (NamedEnum<T>) {
    return std::string(enum_name(value));
  } else if constexpr (std::is_same_v<T, std::string>) {
    return value;
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    std::string text;
    for (const int64_t v : value) text += (text.empty() ? "" : ",") + std::to_string(v);
    return text;
  } else {
    static_assert(std::is_same_v<T, Device>, "a configuration field of a type without text");
    return value.str();
  }
}

// The value `text` spells; otherwise an rd::Error of `code` saying what `what` must be.
template <class T>
T from_text(std::string_view text, std::string_view what, ErrorCode code) {
  std::optional<T> value;
  if constexpr (std::is_same_v<T, bool>) {
    if (text == "true" || text == "false") value = text == "true";
  } else if constexpr (std::is_arithmetic_v<T>) {
    value = number_from_text<T>(text);
  } else if constexpr (NamedEnum<T>) {
    value = enum_from_name<T>(text);
  } else if constexpr (std::is_same_v<T, std::string>) {
    value = std::string(text);
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    value.emplace();  // comma separated, as Abseil's list flags
    for (size_t at = 0; at < text.size();) {
      const size_t comma = std::min(text.find(',', at), text.size());
      const std::string_view item = text.substr(at, comma - at);
      const std::optional<int64_t> number = number_from_text<int64_t>(item);
      if (!number) throw Error(code, str_cat(what, " has '", item, "', not an integer"));
      value->push_back(*number);
      at = comma + 1;
    }
  } else {
    value = device_from_text(text);
  }
  if (!value) fail_value(code, what, expected_form<T>(), quoted(text));
  return *std::move(value);
}

template <class T>
Json to_json(const T& value) {
  if constexpr (NamedEnum<T> || std::is_same_v<T, Device>) {
    return to_text(value);
  } else {
    return value;
  }
}

template <class T>
T from_json(const Json& j, std::string_view what) {
  constexpr ErrorCode kCode = ErrorCode::kCorruptFile;
  if constexpr (NamedEnum<T> || std::is_same_v<T, Device> || std::is_same_v<T, std::string>) {
    if (j.is_string()) return from_text<T>(j.get<std::string>(), what, kCode);
  } else {
    bool fits = false;
    if constexpr (std::is_same_v<T, bool>) {
      fits = j.is_boolean();
    } else if constexpr (std::is_unsigned_v<T>) {
      fits = j.is_number_unsigned();
    } else if constexpr (std::is_integral_v<T>) {
      fits = j.is_number_integer();
    } else if constexpr (std::is_floating_point_v<T>) {
      fits = j.is_number();
    } else {
      static_assert(std::is_same_v<T, std::vector<int64_t>>, "a field type without JSON");
      fits = j.is_array() &&
             std::all_of(j.begin(), j.end(), [](const Json& v) { return v.is_number_integer(); });
    }
    if (fits) return j.get<T>();
  }
  fail_value(kCode, what, expected_form<T>(), j.dump());
}

// Calls act(member) with the member of `config` that `field` describes.
template <class Config, class Act>
void with_member(Config& config, const ConfigField& field, Act&& act) {
  bool found = false;
  visit_config_fields(config, [&](auto& value, const ConfigField& f) {
    if (f.section != field.section || f.key != field.key) return;
    act(value);
    found = true;
  });
  RD_CHECK(found, kInternal, kOp, ": the configuration has no field ", field.name());
}

// Whether every step of both runs gets the same learning rate although `steps` may differ:
// a constant decay after the same warmup (the cosine and linear decays stretch with steps).
bool same_schedule(const TrainConfig& a, const TrainConfig& b) {
  const auto warmup = [](const TrainConfig& c) { return std::min(c.warmup_steps, c.steps - 1); };
  return a.decay == nn::LrDecay::kConstant && b.decay == nn::LrDecay::kConstant &&
         warmup(a) == warmup(b);
}

}  // namespace

// ---------------------------------------------------------------------------------------
// The description's fields as values.

std::vector<ConfigField> config_fields() {
  std::vector<ConfigField> fields;
  const TrainConfig defaults;
  visit_config_fields(defaults, [&](const auto&, const ConfigField& f) { fields.push_back(f); });
  return fields;
}

std::optional<ConfigField> config_field_of_flag(std::string_view flag) {
  for (const ConfigField& f : config_fields()) {
    if (!f.flag.empty() && f.flag == flag) return f;
  }
  return std::nullopt;
}

std::string config_field_text(const TrainConfig& config, const ConfigField& field) {
  std::string text;
  with_member(config, field, [&](const auto& value) { text = to_text(value); });
  return text;
}

void set_config_field(TrainConfig& config, const ConfigField& field, std::string_view text,
                      std::string_view what) {
  with_member(config, field, [&](auto& value) {
    value = from_text<std::decay_t<decltype(value)>>(text, what, ErrorCode::kInvalidArgument);
  });
}

std::string cli_default_text(const ConfigField& field) {
  return field.cli_default ? std::string(*field.cli_default)
                           : config_field_text(TrainConfig{}, field);
}

// ---------------------------------------------------------------------------------------
// Saved configurations.

std::string config_to_json(const TrainConfig& config) {
  Json j = Json::object();
  visit_config_fields(config, [&](const auto& value, const ConfigField& f) {
    j[std::string(f.section)][std::string(f.key)] = to_json(value);
  });
  return j.dump();
}

TrainConfig config_from_json(const std::string& text) {
  const Json j = Json::parse(text, nullptr, false);
  RD_CHECK(!j.is_discarded() && j.is_object() && j.contains("model") && j.contains("data") &&
               j.contains("train"),
           kCorruptFile, kOp, ": the saved configuration is not valid");
  TrainConfig c;
  visit_config_fields(c, [&](auto& value, const ConfigField& f) {
    using T = std::decay_t<decltype(value)>;
    const std::string what = str_cat(kOp, ": the saved configuration's ", f.name());
    const auto section = j.find(std::string(f.section));
    if (section != j.end() && section->is_object() && section->contains(std::string(f.key))) {
      value = from_json<T>(section->at(std::string(f.key)), what);
    } else if (f.if_missing) {
      value = from_text<T>(*f.if_missing, what, ErrorCode::kInternal);
    }
  });
  return c;
}

TrainConfig config_from_checkpoint(const std::string& trainer_state) {
  const Json j = Json::parse(trainer_state, nullptr, false);
  RD_CHECK(!j.is_discarded() && j.contains("config"), kCorruptFile, kOp,
           ": the checkpoint's trainer state has no configuration");
  return config_from_json(j["config"].dump());
}

std::vector<std::string> config_changes(const TrainConfig& saved, const TrainConfig& now) {
  const Json was = Json::parse(config_to_json(saved)), is = Json::parse(config_to_json(now));
  std::vector<std::string> changes;
  for (const ConfigField& f : config_fields()) {
    if (f.on_resume == OnResume::kMayChange) continue;
    if (f.name() == "train.steps" && same_schedule(saved, now)) continue;
    const Json& a = was.at(std::string(f.section)).at(std::string(f.key));
    const Json& b = is.at(std::string(f.section)).at(std::string(f.key));
    if (a != b) changes.push_back(str_cat(f.name(), ": saved ", a.dump(), ", now ", b.dump()));
  }
  return changes;
}

}  // namespace rd::train
