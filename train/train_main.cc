// rd_train: trains a small long-context language model (docs/training.md), or samples from
// one of its checkpoints:
//   rd_train [--flags]                       train (defaults: the passkey task on the CPU)
//   rd_train sample --checkpoint=DIR --prompt="..."
// Flags: --help lists them (and exits 0); --flagfile=FILE reads them from a file
// (train/configs/).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/marshalling.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "ringdilated/dist/bootstrap.h"
#include "ringdilated/kernels/error.h"
#if defined(RD_WITH_CUDNN)
#include "ringdilated/kernels/cuda/cudnn_attention.h"
#endif
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/tensor.h"
#include "ringdilated/train/checkpoint.h"
#include "ringdilated/train/tokenizer.h"
#include "ringdilated/train/trainer.h"

namespace {

// The default of the configuration flag `flag` as its Abseil type, from the description
// (train_config.h). A flag without a described field, or a default that is not a value of
// its type, is a bug: it stops the program at the flag's first use.
template <class T>
T config_flag_default(std::string_view flag) {
  const std::optional<rd::train::ConfigField> field = rd::train::config_field_of_flag(flag);
  std::string text, error;
  T value{};
  if (field) text = rd::train::cli_default_text(*field);
  if (!field || !absl::ParseFlag(text, &value, &error)) {
    std::fprintf(stderr, "rd_train: internal error: flag --%.*s %s %s\n",
                 static_cast<int>(flag.size()), flag.data(),
                 field ? "has a bad default:" : "describes no configuration field", error.c_str());
    std::abort();
  }
  return value;
}

std::string config_flag_help(std::string_view flag) {
  const std::optional<rd::train::ConfigField> field = rd::train::config_field_of_flag(flag);
  return field ? std::string(field->help) : std::string();
}

}  // namespace

// The flags of TrainConfig's fields: their defaults and help come from the description
// (rd::train::visit_config_fields), and config_from_flags() copies every described field.
#define RD_CONFIG_FLAG(Type, name) \
  ABSL_FLAG(Type, name, config_flag_default<Type>(#name), config_flag_help(#name))

// Data.
RD_CONFIG_FLAG(std::string, data);
RD_CONFIG_FLAG(int64_t, seq_len);
RD_CONFIG_FLAG(int64_t, passkey_digits);
RD_CONFIG_FLAG(int64_t, mqar_pairs);
RD_CONFIG_FLAG(int64_t, mqar_queries);
RD_CONFIG_FLAG(int64_t, mqar_key_len);
RD_CONFIG_FLAG(int64_t, mqar_value_len);
RD_CONFIG_FLAG(int64_t, copy_length);
RD_CONFIG_FLAG(uint64_t, data_seed);
RD_CONFIG_FLAG(std::string, loss_on);
RD_CONFIG_FLAG(double, val_fraction);
RD_CONFIG_FLAG(std::string, documents);
// Model.
RD_CONFIG_FLAG(int64_t, dim);
RD_CONFIG_FLAG(int64_t, depth);
RD_CONFIG_FLAG(int64_t, heads);
RD_CONFIG_FLAG(int64_t, kv_heads);
RD_CONFIG_FLAG(double, mlp_ratio);
RD_CONFIG_FLAG(std::string, mlp);
RD_CONFIG_FLAG(std::vector<std::string>, segments);
RD_CONFIG_FLAG(std::vector<std::string>, dilations);
RD_CONFIG_FLAG(std::string, variant);
RD_CONFIG_FLAG(std::string, mixing);
RD_CONFIG_FLAG(std::string, offset_rule);
RD_CONFIG_FLAG(double, attention_dropout);
RD_CONFIG_FLAG(double, rope_base);
RD_CONFIG_FLAG(double, init_std);
RD_CONFIG_FLAG(bool, recompute);
RD_CONFIG_FLAG(int64_t, mlp_chunk_tokens);
// Optimization.
RD_CONFIG_FLAG(int64_t, steps);
RD_CONFIG_FLAG(int64_t, batch_size);
RD_CONFIG_FLAG(int64_t, tokens_per_step);
RD_CONFIG_FLAG(double, lr);
RD_CONFIG_FLAG(double, min_lr_ratio);
RD_CONFIG_FLAG(int64_t, warmup_steps);
RD_CONFIG_FLAG(std::string, decay);
RD_CONFIG_FLAG(double, weight_decay);
RD_CONFIG_FLAG(double, beta1);
RD_CONFIG_FLAG(double, beta2);
RD_CONFIG_FLAG(double, grad_clip);
RD_CONFIG_FLAG(std::string, dtype);
RD_CONFIG_FLAG(uint64_t, seed);
// Parallelism.
RD_CONFIG_FLAG(int, context_parallel);
RD_CONFIG_FLAG(std::string, strategy);
RD_CONFIG_FLAG(std::string, cp_layout);
// The run: device, evaluation, logging, checkpoints.
RD_CONFIG_FLAG(std::string, device);
RD_CONFIG_FLAG(int64_t, eval_every);
RD_CONFIG_FLAG(int64_t, eval_batches);
RD_CONFIG_FLAG(double, stop_at_exact_match);
RD_CONFIG_FLAG(int64_t, final_eval_batches);
RD_CONFIG_FLAG(int64_t, log_every);
RD_CONFIG_FLAG(int64_t, checkpoint_every);
RD_CONFIG_FLAG(int, keep_checkpoints);
RD_CONFIG_FLAG(std::string, out_dir);
RD_CONFIG_FLAG(std::string, resume);
RD_CONFIG_FLAG(bool, allow_config_change);
RD_CONFIG_FLAG(bool, quiet);

// Not part of the configuration.
ABSL_FLAG(int, threads, 0,
          "CPU threads; 0: OMP_NUM_THREADS if set (rd_launch sets it to each rank's share of "
          "the cores), else every core");
// Sampling (rd_train sample).
ABSL_FLAG(std::string, checkpoint, "", "sample: the checkpoint folder (or a run folder: its newest)");
ABSL_FLAG(std::string, prompt, "", "sample: the prompt text");
ABSL_FLAG(int64_t, max_new_tokens, 64, "sample: tokens to generate");
ABSL_FLAG(double, temperature, 0.0, "sample: 0 is greedy");
ABSL_FLAG(int64_t, top_k, 0, "sample: keep the k most likely tokens; 0: all");

namespace {

using rd::train::TrainConfig;

bool defined_here(std::string_view file) { return file.find("train_main.") != std::string_view::npos; }

// Ctrl-C asks the trainer to stop at its next logged step, after a checkpoint. The flag is
// the one piece of global state a signal handler can set.
std::atomic<bool> g_stop_requested{false};

void on_interrupt(int) { g_stop_requested = true; }

// --segments and --dilations: one rate per length, each length a multiple of its rate.
void check_attention_pairs(const std::vector<int64_t>& segments, const std::vector<int64_t>& dilations) {
  RD_CHECK(!segments.empty() && segments.size() == dilations.size(), kInvalidArgument,
           "--segments has ", segments.size(), " values and --dilations ", dilations.size(),
           ": give one dilation rate per segment length");
  for (size_t i = 0; i < segments.size(); ++i) {
    RD_CHECK(segments[i] >= 1 && dilations[i] >= 1 && segments[i] % dilations[i] == 0,
             kInvalidArgument, "--segments and --dilations: pair ", i + 1, " (segment length ",
             segments[i], ", dilation ", dilations[i],
             ") needs both >= 1 and the length a multiple of the dilation");
  }
}

// Range checks of the numeric flags, naming the flag: the trainer checks its configuration
// too, but by its field names, which are not always the flags'.
void check_flag_ranges() {
  struct AtLeast {
    const char* flag;
    int64_t value, min;
    const char* meaning;  // of the smallest values, or ""
  };
  const AtLeast ints[] = {
      {"seq_len", absl::GetFlag(FLAGS_seq_len), 1, ""},
      {"passkey_digits", absl::GetFlag(FLAGS_passkey_digits), 1, ""},
      {"mqar_pairs", absl::GetFlag(FLAGS_mqar_pairs), 1, ""},
      {"mqar_queries", absl::GetFlag(FLAGS_mqar_queries), 1, ""},
      {"mqar_key_len", absl::GetFlag(FLAGS_mqar_key_len), 1, ""},
      {"mqar_value_len", absl::GetFlag(FLAGS_mqar_value_len), 1, ""},
      {"copy_length", absl::GetFlag(FLAGS_copy_length), 0, " (0: as long as fits)"},
      {"dim", absl::GetFlag(FLAGS_dim), 1, ""},
      {"depth", absl::GetFlag(FLAGS_depth), 1, ""},
      {"heads", absl::GetFlag(FLAGS_heads), 1, ""},
      {"mlp_chunk_tokens", absl::GetFlag(FLAGS_mlp_chunk_tokens), 0, " (0: the whole sequence)"},
      {"steps", absl::GetFlag(FLAGS_steps), 1, ""},
      {"batch_size", absl::GetFlag(FLAGS_batch_size), 1, ""},
      {"tokens_per_step", absl::GetFlag(FLAGS_tokens_per_step), 0, " (0: one micro-batch)"},
      {"warmup_steps", absl::GetFlag(FLAGS_warmup_steps), 0, ""},
      {"eval_every", absl::GetFlag(FLAGS_eval_every), 0, " (0: only at the end)"},
      {"eval_batches", absl::GetFlag(FLAGS_eval_batches), 1, ""},
      {"final_eval_batches", absl::GetFlag(FLAGS_final_eval_batches), 1, ""},
      {"log_every", absl::GetFlag(FLAGS_log_every), 1, ""},
      {"checkpoint_every", absl::GetFlag(FLAGS_checkpoint_every), 0, " (0: only at the end)"},
      {"keep_checkpoints", absl::GetFlag(FLAGS_keep_checkpoints), 1, ""},
      {"threads", absl::GetFlag(FLAGS_threads), 0, " (0: OMP_NUM_THREADS, else every core)"},
      {"context_parallel", absl::GetFlag(FLAGS_context_parallel), 1,
       " (ranks per context-parallel group; 1: none)"},
      {"max_new_tokens", absl::GetFlag(FLAGS_max_new_tokens), 0, ""},
      {"top_k", absl::GetFlag(FLAGS_top_k), 0, " (0: every token)"}};
  for (const AtLeast& f : ints) {
    RD_CHECK(f.value >= f.min, kInvalidArgument, "--", f.flag, " must be >= ", f.min, f.meaning,
             ", got ", f.value);
  }
  struct Within {
    const char* flag;
    double value, low, high;
    bool low_open;  // value > low rather than >= low
  };
  const double inf = INFINITY;
  const Within reals[] = {{"lr", absl::GetFlag(FLAGS_lr), 0, inf, true},
                          {"min_lr_ratio", absl::GetFlag(FLAGS_min_lr_ratio), 0, 1, false},
                          {"weight_decay", absl::GetFlag(FLAGS_weight_decay), 0, inf, false},
                          {"grad_clip", absl::GetFlag(FLAGS_grad_clip), 0, inf, false},
                          {"mlp_ratio", absl::GetFlag(FLAGS_mlp_ratio), 0, inf, true},
                          {"rope_base", absl::GetFlag(FLAGS_rope_base), 1, inf, true},
                          {"init_std", absl::GetFlag(FLAGS_init_std), 0, inf, true},
                          {"attention_dropout", absl::GetFlag(FLAGS_attention_dropout), 0, 1, false},
                          {"beta1", absl::GetFlag(FLAGS_beta1), 0, 1, false},
                          {"beta2", absl::GetFlag(FLAGS_beta2), 0, 1, false},
                          {"val_fraction", absl::GetFlag(FLAGS_val_fraction), 0, 1, false},
                          {"temperature", absl::GetFlag(FLAGS_temperature), 0, inf, false},
                          {"stop_at_exact_match", absl::GetFlag(FLAGS_stop_at_exact_match), 0, 1, false}};
  for (const Within& f : reals) {
    const bool above = f.low_open ? f.value > f.low : f.value >= f.low;
    RD_CHECK(std::isfinite(f.value) && above && f.value <= f.high, kInvalidArgument, "--", f.flag,
             " must be ", f.low_open ? "> " : ">= ", f.low,
             std::isfinite(f.high) ? rd::str_cat(" and <= ", f.high) : std::string(), ", got ", f.value);
  }
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  RD_CHECK(dtype.empty() || rd::train::compute_dtype_named(dtype).has_value(), kInvalidArgument,
           "--dtype must be float32, bfloat16, float16, float64 or empty (the device's "
           "recommendation), got '",
           dtype, "'");
}

// A GPU asked for by --device must be visible (checked here, before any data is read or
// generated, naming the flag as given).
void check_device_visible(rd::Device device) {
  if (device.is_cpu()) return;
  const int count = rd::cuda_device_count();
#if defined(RD_WITH_CUDA)
  const char* none = "no CUDA GPU is visible";
#else
  const char* none = "this build has no CUDA backend (the cpu preset)";
#endif
  RD_CHECK(device.index < count, kDeviceMismatch, "--device=", absl::GetFlag(FLAGS_device), ": ",
           count == 0 ? std::string(none) + "; use --device=cpu (or auto)"
                      : rd::str_cat("only ", count, " CUDA GPUs are visible (cuda:0 to cuda:", count - 1, ")"));
}

// --device (auto resolved); a GPU must be visible.
rd::Device device_from_flag() {
  TrainConfig c;
  rd::train::set_config_field(c, *rd::train::config_field_of_flag("device"),
                              absl::GetFlag(FLAGS_device), "--device");
  check_device_visible(c.device);
  return c.device;
}

// The configuration the flags give: every field of the description from its flag.
TrainConfig config_from_flags() {
  check_flag_ranges();
  TrainConfig c;
  for (const rd::train::ConfigField& field : rd::train::config_fields()) {
    if (field.flag.empty()) continue;  // the trainer sets it
    const absl::CommandLineFlag* flag =
        absl::FindCommandLineFlag(absl::string_view(field.flag.data(), field.flag.size()));
    RD_CHECK(flag != nullptr && defined_here(flag->Filename()), kInternal,
             "the configuration field ", field.name(), " has no flag --", field.flag);
    rd::train::set_config_field(c, field, flag->CurrentValue(), rd::str_cat("--", field.flag));
  }
  check_attention_pairs(c.model.attention.segment_lengths, c.model.attention.dilation_rates);
  check_device_visible(c.device);
  return c;
}

// The job's communicator when a launcher started several ranks (WORLD_SIZE or OMPI_*), else
// none. Ranks on GPUs use NCCL, one GPU each (LOCAL_RANK picks it); CPU ranks use Gloo.
std::shared_ptr<rd::dist::Communicator> world_from_launcher(TrainConfig& c) {
  const char* size = std::getenv("WORLD_SIZE");
  if (size == nullptr) size = std::getenv("OMPI_COMM_WORLD_SIZE");
  if (size == nullptr || std::string(size) == "1") return nullptr;
  const rd::dist::LaunchEnv env = rd::dist::launch_env_from_environment();
  rd::dist::ProcessGroupOptions options;
  if (c.device.is_cuda()) {
    c.device = rd::Device::cuda(env.local_rank);
    options.backend = "nccl";
    options.device = c.device;
  }
  return rd::dist::init_process_group(env, options);
}

// How many cuDNN attention graphs the run built (each a pause of tens of milliseconds) and
// evicted: a cache that keeps evicting rebuilds graphs at every step (documents whose piece
// counts and lengths vary make many shapes).
void print_cudnn_graphs(const TrainConfig& c) {
#if defined(RD_WITH_CUDNN)
  if (c.device.is_cpu()) return;
  const rd::kernels::cuda::CudnnGraphCacheStats g = rd::kernels::cuda::cudnn_graph_cache_stats();
  if (g.builds == 0) return;
  std::printf("cuDNN attention graphs: %lld built, %lld reused, %lld evicted (a cache of %lld)\n",
              static_cast<long long>(g.builds), static_cast<long long>(g.hits),
              static_cast<long long>(g.evictions), static_cast<long long>(g.capacity));
#else
  (void)c;
#endif
}

// A bad RD_CUDNN_GRAPH_CACHE stops the run at its start: the cache reads the variable when
// it is first used, which would be the first cuDNN attention call or, in a run that makes
// none, the closing statistics after training.
void check_cudnn_graph_cache(const TrainConfig& c) {
#if defined(RD_WITH_CUDNN)
  if (c.device.is_cuda()) (void)rd::kernels::cuda::cudnn_graph_cache_stats();
#else
  (void)c;
#endif
}

// The run's last lines: what the held-out evaluation measured (exact match for tasks with
// answers; loss, perplexity and bits per byte for text), where the checkpoint and metrics are.
void print_result(const rd::train::TrainResult& r, const TrainConfig& c) {
  if (r.stopped) {
    std::printf("stopped at step %lld; checkpoint %s (resume with the same command)\n",
                static_cast<long long>(r.steps_done), r.checkpoint.c_str());
    return;
  }
  const rd::train::EvalResult& e = r.final_eval;
  std::printf("done: %lld steps in %.0f s", static_cast<long long>(r.steps_done), r.seconds);
  if (r.target_step) {
    std::printf(" (stopped at the target: %.1f%% exact match at step %lld)", 100 * r.target_exact_match,
                static_cast<long long>(*r.target_step));
  }
  std::printf("; ");
  if (e.has_answers) {
    std::printf("held-out exact match %.1f%% (%lld of %lld samples), answer tokens %.1f%%, loss %.4f\n",
                100 * e.accuracy.exact_match(), static_cast<long long>(e.accuracy.exact_samples),
                static_cast<long long>(e.accuracy.samples), 100 * e.accuracy.token_accuracy(), e.loss);
  } else {
    std::printf("held-out loss %.4f, perplexity %.3f", e.loss, e.perplexity);
    if (e.bits_per_byte) std::printf(", %.3f bits per byte", *e.bits_per_byte);
    std::printf(" (%lld tokens)\n", static_cast<long long>(e.tokens));
  }
  std::printf("checkpoint %s\nmetrics %s/metrics.jsonl\n", r.checkpoint.c_str(), c.out_dir.c_str());
  print_cudnn_graphs(c);
}

int train() {
  TrainConfig c = config_from_flags();
  check_cudnn_graph_cache(c);
  if (const int threads = absl::GetFlag(FLAGS_threads); threads > 0) rd::set_num_threads(threads);
  std::shared_ptr<rd::dist::Communicator> world = world_from_launcher(c);
  const bool root = !world || world->rank() == 0;
  std::signal(SIGINT, on_interrupt);
  std::signal(SIGTERM, on_interrupt);
  rd::train::Trainer trainer(c, world);
  if (root && trainer.step() > 0) {
    std::printf("resuming at step %lld from %s\n", static_cast<long long>(trainer.step()),
                trainer.last_checkpoint().c_str());
  }
  const rd::train::TrainResult r = trainer.run(&g_stop_requested);
  if (root) print_result(r, c);
  return 0;
}

// Samples from a checkpoint: it reads (and verifies) only the weights and the configuration,
// so a damaged optimizer file does not stand in the way.
int sample() {
  check_flag_ranges();
  std::string path = absl::GetFlag(FLAGS_checkpoint);
  RD_CHECK(!path.empty(), kInvalidArgument, "sample: --checkpoint is required");
  const rd::Device device = device_from_flag();
  if (!std::filesystem::exists(std::filesystem::path(path) / "manifest.json")) {
    // A run folder: its newest checkpoint.
    const auto latest = rd::train::latest_checkpoint((std::filesystem::path(path) / "checkpoints").string());
    RD_CHECK(latest.has_value(), kInvalidArgument, "sample: --checkpoint '", path,
             "' is neither a checkpoint nor a run folder with checkpoints");
    path = *latest;
  }
  const rd::train::CheckpointContents ck =
      rd::train::load_checkpoint(path, rd::train::CheckpointParts::kWeights);
  TrainConfig c = rd::train::config_from_checkpoint(ck.trainer_state);
  // The sampling device's compute dtype (--dtype, else its recommendation: bf16 on a GPU),
  // not the float32 of the saved weights.
  TrainConfig sampling;
  sampling.device = device;
  sampling.dtype = absl::GetFlag(FLAGS_dtype);
  const rd::DType dtype = rd::train::compute_dtype(sampling);
  rd::Generator gen(c.seed);
  rd::train::LanguageModel model(c.model, gen, rd::TensorOptions(rd::DType::kFloat32).with_device(device));
  model.load_state_dict(ck.model);
  model.to(dtype);
  const rd::train::ByteTokenizer tokenizer;
  std::vector<int32_t> prompt = tokenizer.encode(absl::GetFlag(FLAGS_prompt));
  if (prompt.empty()) prompt = {rd::train::ByteTokenizer::kBos};
  const auto start = std::chrono::steady_clock::now();
  const std::vector<int32_t> out = rd::train::generate(
      model, prompt, absl::GetFlag(FLAGS_max_new_tokens), absl::GetFlag(FLAGS_temperature),
      absl::GetFlag(FLAGS_top_k), absl::GetFlag(FLAGS_seed));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%s\n", tokenizer.decode(out).c_str());
  if (!absl::GetFlag(FLAGS_quiet)) {
    const auto generated = static_cast<long long>(out.size() - prompt.size());
    std::fprintf(
        stderr,
        "sample: %lld tokens after a %zu-token prompt in %.2f s (%.1f tokens/s), %s on %s\n",
        generated, prompt.size(), seconds,
        seconds > 0 ? static_cast<double>(generated) / seconds : 0.0,
        std::string(rd::dtype_name(dtype)).c_str(), device.str().c_str());
  }
  return 0;
}

// `text` broken at spaces into lines of at most `width` characters, each after `indent`.
std::string wrapped(const std::string& text, size_t width, const std::string& indent) {
  std::string out, line;
  std::istringstream words(text);
  for (std::string word; words >> word;) {
    if (!line.empty() && line.size() + 1 + word.size() > width) {
      out += indent + line + "\n";
      line.clear();
    }
    line += (line.empty() ? "" : " ") + word;
  }
  return out + indent + line + "\n";
}

// --help (also -h, --helpshort) lists this program's flags, --helpfull every flag (Abseil's
// too); both exit 0. Abseil's own handling exits 1 after help, which scripts take for a
// failure, so these are answered before absl::ParseCommandLine sees them.
bool print_help_if_asked(int argc, char** argv) {
  bool asked = false, full = false;
  for (int i = 1; i < argc && std::string_view(argv[i]) != "--"; ++i) {
    const std::string_view arg = argv[i];
    for (const char* name : {"-h", "-help", "--help", "-helpshort", "--helpshort"}) asked |= arg == name;
    full |= arg == "-helpfull" || arg == "--helpfull";
  }
  if (!asked && !full) return false;
  std::vector<const absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (full || defined_here(flag->Filename())) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(), [](const auto* a, const auto* b) { return a->Name() < b->Name(); });
  std::printf("rd_train: %s\n\nFlags:\n", std::string(absl::ProgramUsageMessage()).c_str());
  for (const absl::CommandLineFlag* flag : flags) {
    std::printf("  --%s (default: %s)\n%s", std::string(flag->Name()).c_str(),
                flag->DefaultValue().empty() ? "empty" : flag->DefaultValue().c_str(),
                wrapped(flag->Help(), 84, "      ").c_str());
  }
  std::printf("\n--flagfile=FILE reads flags from a file (train/configs/); later flags override it.%s\n",
              full ? "" : "\n--helpfull also lists Abseil's own flags.");
  return true;
}

// OpenMP's worker threads spin after each parallel region (libgomp's default: active
// waiting) while OpenBLAS's own thread pool (Debian's pthread build) runs the GEMMs between
// the regions, so the two fight over the cores: on 2 cores the default passkey run trained at
// about 12k tokens/s, and at 33k to 37k with passive waiting (the same losses). libgomp reads
// OMP_WAIT_POLICY as it loads, before main, so setting it takes a fresh start of this program:
// once, and never over the user's own setting. A failed exec just runs on with the default.
void start_with_passive_openmp_waiting(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  setenv("OMP_WAIT_POLICY", "PASSIVE", /*overwrite=*/1);
  execv("/proc/self/exe", argv);
}

}  // namespace

int main(int argc, char** argv) {
  start_with_passive_openmp_waiting(argv);
  absl::SetProgramUsageMessage(
      "trains a long-context language model with dilated attention.\n"
      "  rd_train [--flags]         train (defaults: the passkey task, a GPU if present)\n"
      "  rd_train sample --checkpoint=DIR --prompt=TEXT\n"
      "See docs/training.md.");
  // Abseil's --helpshort, --helpon and --helpmatch then find this program's flags too.
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return defined_here(std::string_view(file.data(), file.size()));
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  if (print_help_if_asked(argc, argv)) return 0;
  const std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  try {
    if (args.size() >= 2 && std::string(args[1]) == "sample") return sample();
    if (args.size() >= 2) {
      std::fprintf(stderr, "rd_train: unknown command '%s' (train is the default; or sample)\n", args[1]);
      return 2;
    }
    return train();
  } catch (const std::exception& e) {  // rd::Error names the flag or the file
    std::fprintf(stderr, "rd_train: %s\n", e.what());
    return 1;
  }
}
